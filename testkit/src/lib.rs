//! What the tests and the benchmarks share, and nothing a release build of
//! `strata` needs: private clusters and databases for tests (`clusters.rs`),
//! a private PgBouncer (`bouncer.rs`), and the one way a test waits for a
//! condition (`poll.rs`); standbys made synchronous, cut off and let back
//! (`standbys.rs`); a headless Chromium driven over WebDriver (`browser.rs`);
//! a TCP proxy whose links can be cut or held silent (`cut.rs`).

mod bouncer;
pub mod browser;
mod clusters;
pub mod cut;
mod poll;
pub mod standbys;

pub use bouncer::{Bouncer, BouncerOptions};
pub use clusters::{
    fresh_database, migrated_database, next_release, shared_cluster, temp_bouncer, temp_cluster,
    temp_cluster_with, temp_standby,
};
pub use poll::{eventually, wait_for, wait_until};
