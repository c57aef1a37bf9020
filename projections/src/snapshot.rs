//! rkyv snapshots of the index's [`State`] at a position.
//!
//! A file is a 40-byte header (magic, format version, position, payload
//! length, checksum) and the rkyv archive. Loading checks all of them and
//! validates the archive (bytecheck), so a truncated or altered file is an
//! error, never a crash; the store then falls back to an older snapshot.

use crate::index::State;
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"STRATAIX";
// 2: nodes record contact lost and why they left.
// 4: nodes carry a rail group.
// 5: GPUs carry a waiting fault and a quarantine, nodes a waiting fault and
//    the fault they were drained for, pools their fault policy.
// 6: nodes and GPUs carry a failed acceptance check.
// 7: devices name the GPU they are a MIG instance of, and whether a
//    diagnostic passed them since their quarantine.
// 8: reservations in a hash map.
const FORMAT: u32 = 12;
const HEADER: usize = 40;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a snapshot: {0}")]
    Invalid(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A fast checksum over 8-byte words (not cryptographic: it catches
/// truncation and corruption, while bytecheck catches malformed structure).
fn checksum(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15 ^ bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = (h ^ w).wrapping_mul(0x1000_0000_01b3).rotate_left(23);
    }
    for &b in chunks.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x1000_0000_01b3);
    }
    h
}

/// Encodes a state as a snapshot file's bytes.
pub fn encode(state: &State) -> Vec<u8> {
    let payload = rkyv::to_bytes::<rkyv::rancor::Error>(state).expect("the index serializes");
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&state.position.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&checksum(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Decodes a snapshot file's bytes.
pub fn decode(bytes: &[u8]) -> Result<State, SnapshotError> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return Err(SnapshotError::Invalid("bad magic or short header".into()));
    }
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let format = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if format != FORMAT {
        return Err(SnapshotError::Invalid(format!(
            "format {format}, this build reads format {FORMAT}"
        )));
    }
    let position = word(16);
    let len = word(24);
    let sum = word(32);
    let payload = &bytes[HEADER..];
    if payload.len() as u64 != len {
        return Err(SnapshotError::Invalid(format!(
            "payload is {} bytes, header says {len} (truncated?)",
            payload.len()
        )));
    }
    if checksum(payload) != sum {
        return Err(SnapshotError::Invalid("checksum mismatch".into()));
    }
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(payload.len());
    aligned.extend_from_slice(payload);
    let archived = rkyv::access::<crate::index::ArchivedState, rkyv::rancor::Error>(&aligned)
        .map_err(|e| SnapshotError::Invalid(format!("archive does not validate: {e}")))?;
    let state: State = rkyv::deserialize::<State, rkyv::rancor::Error>(archived)
        .map_err(|e| SnapshotError::Invalid(format!("archive does not decode: {e}")))?;
    if state.position != position {
        return Err(SnapshotError::Invalid(format!(
            "header position {position} but archive position {}",
            state.position
        )));
    }
    Ok(state)
}

/// A directory of snapshots, newest kept, older ones pruned.
#[derive(Debug, Clone)]
pub struct SnapshotStore {
    dir: PathBuf,
    keep: usize,
}

impl SnapshotStore {
    pub fn new(dir: impl Into<PathBuf>) -> SnapshotStore {
        SnapshotStore {
            dir: dir.into(),
            keep: 2,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Snapshot files, newest first.
    fn files(&self) -> Result<Vec<(u64, PathBuf)>, SnapshotError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(&self.dir)(e)),
        };
        let mut files = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io(&self.dir))?;
            let name = entry.file_name();
            let Some(pos) = name
                .to_str()
                .and_then(|n| n.strip_prefix("index-"))
                .and_then(|n| n.strip_suffix(".snap"))
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            files.push((pos, entry.path()));
        }
        files.sort_by_key(|f| std::cmp::Reverse(f.0));
        Ok(files)
    }

    /// Writes a snapshot (to a temporary file, synced, then renamed) and
    /// prunes all but the newest few.
    pub fn write(&self, state: &State) -> Result<PathBuf, SnapshotError> {
        std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        let path = self.dir.join(format!("index-{:020}.snap", state.position));
        let tmp = self.dir.join(format!(".index-{:020}.tmp", state.position));
        let bytes = encode(state);
        {
            let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
            f.write_all(&bytes).map_err(io(&tmp))?;
            f.sync_all().map_err(io(&tmp))?;
        }
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        if let Ok(d) = std::fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        for (_, old) in self.files()?.into_iter().skip(self.keep) {
            let _ = std::fs::remove_file(old);
        }
        Ok(path)
    }

    /// The newest snapshot that loads. Ones that do not are reported and
    /// skipped.
    pub fn latest(&self) -> Result<Option<(PathBuf, State)>, SnapshotError> {
        self.latest_where(|_| true)
    }

    /// The newest snapshot that loads and whose position `valid` accepts.
    pub fn latest_where(
        &self,
        valid: impl Fn(u64) -> bool,
    ) -> Result<Option<(PathBuf, State)>, SnapshotError> {
        for (position, path) in self.files()? {
            if !valid(position) {
                tracing::warn!(path = %path.display(), position, "skipping a snapshot built from events the log no longer has");
                continue;
            }
            let bytes = std::fs::read(&path).map_err(io(&path))?;
            match decode(&bytes) {
                Ok(state) if valid(state.position) => return Ok(Some((path, state))),
                Ok(_) => continue,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "skipping a snapshot that does not load")
                }
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(position: u64) -> State {
        State {
            position,
            ..State::default()
        }
    }

    #[test]
    fn a_snapshot_past_a_takeovers_cut_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let store = SnapshotStore::new(dir.path().join("snaps"));
        for p in [10, 20] {
            store.write(&state(p)).unwrap();
        }
        // 20 was taken from events the log lost (a cut from 15 to 40).
        let valid = |p: u64| !(16..40).contains(&p);
        let (_, s) = store.latest_where(valid).unwrap().unwrap();
        assert_eq!(s.position, 10);
        // With only lost ones kept, the index starts from the log.
        store.write(&state(30)).unwrap();
        assert!(store.latest_where(valid).unwrap().is_none());
        assert_eq!(store.latest().unwrap().unwrap().1.position, 30);
    }

    #[test]
    fn the_store_keeps_the_newest_and_falls_back_past_a_bad_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = SnapshotStore::new(dir.path().join("snaps"));
        assert!(store.latest().unwrap().is_none(), "no directory yet");
        for p in [10, 20, 30] {
            store.write(&state(p)).unwrap();
        }
        assert_eq!(store.files().unwrap().len(), 2, "older ones pruned");
        assert_eq!(store.latest().unwrap().unwrap().1.position, 30);
        // Corrupt the newest: the one before it loads instead.
        let newest = store.files().unwrap()[0].1.clone();
        let mut bytes = std::fs::read(&newest).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&newest, &bytes).unwrap();
        assert_eq!(store.latest().unwrap().unwrap().1.position, 20);
        // Garbage and a wrong format are errors, not panics.
        assert!(decode(b"STRATAIX").is_err());
        assert!(decode(&[0u8; 100]).is_err());
        let mut other = encode(&state(5));
        other[8] = 99;
        assert!(decode(&other)
            .unwrap_err()
            .to_string()
            .contains("format 99"));
    }
}
