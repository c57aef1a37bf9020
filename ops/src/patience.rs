//! A wait for a peer that a busy process cannot mistake for a silent peer.
//!
//! `tokio::time::timeout(15 s, reply)` counts wall time. In a process that
//! waits for a core (a saturated machine, thousands of sessions in one
//! runtime) the reply may sit unread in a socket while the clock runs, and
//! the wait ends as if the peer had not answered: the caller gives up and
//! tries again, adding work where there is already too much. [`patient`]
//! counts only the time this process was able to run: it watches a clock
//! that ticks every [`TICK`] (counted from each wake), and a tick that wakes
//! late counts the tick, not the lateness. A peer that is silent while this process runs freely is
//! given up on after `limit` as before; a starved process waits longer,
//! never more than `most` of wall time (every wait has a deadline).

use std::future::Future;
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};

/// How often the patient clock ticks.
pub const TICK: Duration = Duration::from_millis(250);

/// Why [`patient`] gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GaveUp {
    /// The time counted while this process ran.
    pub counted: Duration,
    /// The wall time waited.
    pub waited: Duration,
}

/// `f`'s output, or [`GaveUp`] once `limit` of the time this process could
/// run has passed without it, or `most` of wall time has.
pub async fn patient<F: Future>(
    limit: Duration,
    most: Duration,
    f: F,
) -> Result<F::Output, GaveUp> {
    let start = Instant::now();
    let mut clock = tokio::time::interval_at(start + TICK, TICK);
    clock.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut counted = Duration::ZERO;
    tokio::pin!(f);
    loop {
        tokio::select! {
            // The answer first: one that arrived while this process waited
            // for a core is taken even when the clock is also due.
            biased;
            out = &mut f => return Ok(out),
            _ = clock.tick() => {
                // Woken on time or late, a wake counts one tick: lateness
                // is time this process could not run.
                counted += TICK;
                let waited = start.elapsed();
                if counted >= limit || waited >= most {
                    return Err(GaveUp { counted, waited });
                }
            }
        }
    }
}

/// Holds the runtime's only thread a second at a time, as a process short
/// of cores is held (the tests of this module and of `process_clock`).
#[cfg(test)]
pub(crate) async fn hog() {
    loop {
        std::thread::sleep(Duration::from_millis(1000));
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn a_silent_peer_is_given_up_on_after_the_limit_when_the_process_runs_freely() {
        let t = std::time::Instant::now();
        let r = patient(
            Duration::from_secs(1),
            Duration::from_secs(10),
            std::future::pending::<()>(),
        )
        .await;
        let gave = r.expect_err("nothing answers");
        assert!(gave.counted >= Duration::from_secs(1), "{gave:?}");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_process_that_cannot_run_waits_longer_but_not_past_its_most() {
        // Another task holds the only thread most of the time, as a
        // process short of cores is held: the wall clock runs, the
        // patient clock mostly does not.
        let hog = tokio::spawn(hog());
        let t = std::time::Instant::now();
        let r = patient(
            Duration::from_secs(1),
            Duration::from_secs(6),
            std::future::pending::<()>(),
        )
        .await;
        let patient_waited = t.elapsed();
        // A plain timeout of the same limit, as starved, gives up as soon
        // as the process runs after the limit: what sent nodes into a
        // reconnect spiral.
        let t = std::time::Instant::now();
        let plain =
            tokio::time::timeout(Duration::from_secs(1), std::future::pending::<()>()).await;
        let plain_waited = t.elapsed();
        hog.abort();
        let gave = r.expect_err("nothing answers");
        assert!(plain.is_err());
        assert!(
            gave.waited > Duration::from_secs(2) && patient_waited > plain_waited,
            "a starved process waits past its limit: {gave:?}, a plain timeout {plain_waited:?}"
        );
        assert!(
            patient_waited < Duration::from_secs(8),
            "and no more than its most: {patient_waited:?}"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_answer_that_came_while_the_process_waited_is_taken() {
        let hog = tokio::spawn(hog());
        // The answer is due after 1.5 s of wall time, past the 1 s limit of
        // a plain timeout; the starved process still takes it.
        let answer = tokio::time::sleep(Duration::from_millis(1500));
        let r = patient(Duration::from_secs(1), Duration::from_secs(10), answer).await;
        hog.abort();
        assert!(r.is_ok(), "{r:?}");
    }
}
