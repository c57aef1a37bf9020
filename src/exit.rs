//! The exit codes of `strata`, the same for every command and distinct
//! from clap's usage error (2), so a script can tell what happened without
//! reading the message.

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

/// An error in a command's work: a database, a file, a peer.
pub const FAILURE: u8 = 1;
/// A request that can never be placed as the pool is (`reserve --wait`).
pub const REJECTED: u8 = 3;
/// Waited as long as asked and the answer had not come (`--timeout`).
pub const TIMED_OUT: u8 = 4;
/// The stream was not at the version given (`events append --expect`).
pub const CONFLICT: u8 = 5;
/// What the command names does not exist (a pool, a sink, a command).
pub const NOT_FOUND: u8 = 6;
/// The reservation ended before it was placed (released, expired, failed).
pub const ENDED: u8 = 7;

/// The codes, as `--help` shows them.
pub const HELP: &str = "Exit codes: 0 done (with --wait: placed); 1 an error; 2 a usage error; \
3 never fits (rejected); 4 timed out waiting; 5 a version conflict (--expect); \
6 not found; 7 ended before it was placed (released, expired or failed)";

/// What the command names does not exist.
#[derive(Debug)]
pub struct NotFound(pub String);

impl std::fmt::Display for NotFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotFound {}

/// A [`NotFound`] error saying `what`.
pub fn not_found(what: impl Into<String>) -> anyhow::Error {
    NotFound(what.into()).into()
}

/// The exit code for a command that failed with `e`.
pub fn of(e: &anyhow::Error) -> ExitCode {
    for cause in e.chain() {
        if cause.downcast_ref::<NotFound>().is_some() {
            return ExitCode::from(NOT_FOUND);
        }
        if let Some(events::AppendError::VersionConflict { .. }) = cause.downcast_ref() {
            return ExitCode::from(CONFLICT);
        }
    }
    ExitCode::from(FAILURE)
}

static ONE_SHOT: AtomicBool = AtomicBool::new(false);
static JSON: AtomicBool = AtomicBool::new(false);
static CSV: AtomicBool = AtomicBool::new(false);

/// `--output csv` (`usage report` only).
pub fn set_csv(yes: bool) {
    CSV.store(yes, Ordering::Relaxed);
}

/// Whether this run prints CSV.
pub fn csv() -> bool {
    CSV.load(Ordering::Relaxed)
}

/// `--output json`: lists print one JSON object per line, shows one object.
pub fn set_json(yes: bool) {
    JSON.store(yes, Ordering::Relaxed);
}

/// Whether this run prints JSON (`--output json`, or a command's `--json`).
pub fn json() -> bool {
    JSON.load(Ordering::Relaxed)
}

/// Prints `value` as one line of JSON.
pub fn print_json(value: &serde_json::Value) {
    print_line(format_args!("{value}"));
}

/// A time as RFC 3339 (seconds), for JSON.
pub fn time(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// Whether this run is a one-shot command (not `serve`, `dev`, `node`,
/// `fleet`): one whose stdout closing ends it.
pub fn one_shot(yes: bool) {
    ONE_SHOT.store(yes, Ordering::Relaxed);
}

/// Writes a line to stdout. When its reader is gone (a closed pipe), a
/// one-shot command exits at once with 0, as `cat` and `grep` end on
/// SIGPIPE, and a long-running one drops the line and goes on; `println!`
/// would panic (exit code 101).
pub fn print_line(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{args}") {
        if e.kind() == std::io::ErrorKind::BrokenPipe && ONE_SHOT.load(Ordering::Relaxed) {
            std::process::exit(0);
        }
    }
}

/// Whether `e` is a write to a stdout whose reader went away.
pub fn broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
