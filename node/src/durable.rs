//! Files written whole or not at all: a temporary file beside the target,
//! flushed, renamed over it, and the folder flushed, so that a crash or a
//! power cut leaves the old file or the new one, never a torn one.

use std::io::Write;
use std::path::Path;

/// Writes `body` to `path` whole or not at all, through `tmp` (in the
/// same folder, so the rename is atomic).
pub(crate) fn write(path: &Path, tmp: &Path, body: &[u8]) -> std::io::Result<()> {
    {
        let mut f = std::fs::File::create(tmp)?;
        f.write_all(body)?;
        f.sync_all()?;
    }
    std::fs::rename(tmp, path)?;
    // The rename itself is durable once the folder is.
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::File::open(dir)?.sync_all()
}
