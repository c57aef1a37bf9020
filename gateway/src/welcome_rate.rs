//! How many sessions may wait for their Welcome at once: as many as this
//! gateway welcomes in [`WAIT`], by Little's law, so that an admitted node
//! is welcomed well inside its own wait (15 s of its process's time) and
//! the rest are pushed back before they queue.
//!
//! A fixed cap (`max_pending_hellos`, 1,000) let a whole fleet powered on at
//! once queue behind a gateway that welcomes a few hundred a second on a
//! busy machine: each admitted node waited longer than its Hello's patience,
//! gave up, tried again, and the abandoned sessions' work was wasted (a
//! reconnect spiral). The cap now follows the rate welcomes are made at,
//! measured each second (what came before counts half as much for every
//! second since),
//! between [`FLOOR`] and `max_pending_hellos`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long an admitted node should wait for its Welcome at most, at the
/// rate this gateway welcomes: a third of the daemon's Hello wait.
pub(crate) const WAIT: Duration = Duration::from_secs(5);

/// Sessions that may always wait at once, whatever the rate (a gateway that
/// has welcomed nobody yet, or nobody for a while): the default of
/// `GatewayConfig::min_pending_hellos`.
pub const FLOOR: usize = 64;

/// Welcomes a second, measured.
pub(crate) struct WelcomeRate {
    state: Mutex<State>,
}

struct State {
    /// The window being counted: since when, and how many so far.
    since: Instant,
    counted: u32,
    /// Welcomes a second, from the windows before.
    rate: f64,
}

impl Default for WelcomeRate {
    fn default() -> Self {
        WelcomeRate {
            state: Mutex::new(State {
                since: Instant::now(),
                counted: 0,
                rate: 0.0,
            }),
        }
    }
}

impl State {
    /// Closes the window once it is a second old.
    fn roll(&mut self, now: Instant) {
        let age = now.saturating_duration_since(self.since);
        if age < Duration::from_secs(1) {
            return;
        }
        // What came before counts half as much for every second since.
        let sample = f64::from(self.counted) / age.as_secs_f64();
        let before = 0.5f64.powf(age.as_secs_f64());
        self.rate = before * self.rate + (1.0 - before) * sample;
        self.since = now;
        self.counted = 0;
    }
}

impl WelcomeRate {
    /// A session was welcomed.
    pub(crate) fn welcomed(&self) {
        self.welcomed_at(Instant::now());
    }

    fn welcomed_at(&self, now: Instant) {
        let mut s = self.state.lock().expect("welcome rate lock");
        s.roll(now);
        s.counted = s.counted.saturating_add(1);
    }

    /// Sessions that may wait for their Welcome at once now: those welcomed
    /// in [`WAIT`] at the rate measured, at least `least`, at most `most`.
    pub(crate) fn cap(&self, least: usize, most: usize) -> usize {
        self.cap_at(Instant::now(), least, most)
    }

    fn cap_at(&self, now: Instant, least: usize, most: usize) -> usize {
        let mut s = self.state.lock().expect("welcome rate lock");
        s.roll(now);
        let by_rate = (s.rate * WAIT.as_secs_f64()) as usize;
        by_rate.max(least).min(most)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_follows_the_rate_welcomes_are_made_at_between_the_floor_and_the_most() {
        let w = WelcomeRate::default();
        let t0 = Instant::now();
        // Nothing welcomed yet: the floor.
        assert_eq!(w.cap_at(t0, FLOOR, 1_000), FLOOR);
        // 200 a second for five seconds: the cap nears 200 * WAIT.
        for s in 0..5u64 {
            for i in 0..200u64 {
                w.welcomed_at(t0 + Duration::from_millis(s * 1000 + i * 5));
            }
        }
        let cap = w.cap_at(t0 + Duration::from_secs(5), FLOOR, 10_000);
        assert!((900..=1_000).contains(&cap), "{cap}");
        // Never past the configured most.
        assert_eq!(w.cap_at(t0 + Duration::from_secs(5), FLOOR, 500), 500);
        // A gateway that stops welcoming (its writes stalled) lets fewer and
        // fewer wait, down to the floor.
        let later = w.cap_at(t0 + Duration::from_secs(12), FLOOR, 10_000);
        assert!(later < cap / 2, "{later} after {cap}");
        assert_eq!(w.cap_at(t0 + Duration::from_secs(60), FLOOR, 10_000), FLOOR);
        // A configured most below the floor wins.
        assert_eq!(w.cap_at(t0 + Duration::from_secs(60), FLOOR, 10), 10);
    }
}
