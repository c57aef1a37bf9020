//! Files written whole or not at all: a temporary file beside the target,
//! renamed over it, so that a reader sees the old file or the new one,
//! never a torn one. [`write`] also flushes the file and the folder, so that
//! a crash or a power cut leaves one of the two as well; [`replace`] does
//! not (for files derived from durable ones and checked at start).

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

/// Puts `body` at `path` whole (through `tmp`, renamed over it), without
/// flushing: readers see it at once, and a power cut may lose it or leave
/// it empty, so it must be derived from a durable file and checked again
/// at start.
pub(crate) fn replace(path: &Path, tmp: &Path, body: &[u8]) -> std::io::Result<()> {
    std::fs::write(tmp, body)?;
    std::fs::rename(tmp, path)
}
