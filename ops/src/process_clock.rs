//! A clock of the time this process could run, as a timer for hyper's
//! HTTP/2 keep-alive.
//!
//! hyper decides that a peer is gone when the answer to its ping has not
//! been read `timeout` after the ping, on the wall clock. In a process that
//! waits for a core (a saturated machine, thousands of sessions in one
//! runtime), the answer may sit unread in the socket while the wall clock
//! runs, and the connection task checks its timer before it reads: the
//! process takes its own lateness for a dead peer, drops a healthy session
//! and adds a reconnect to a machine that already has too much to do.
//!
//! [`ProcessClock`] counts only the time this process could run: a ticker
//! task ticks every [`TICK`], and a tick that wakes late counts one tick,
//! not the lateness. It is a [`hyper::rt::Timer`] whose `now()` is that count, so
//! hyper's whole keep-alive (when it last read, when the next ping is due,
//! when the answer is late) runs on it. A peer that is silent while this
//! process runs freely is given up on after `timeout` as before; a starved
//! process waits longer, and every sleep still ends by the wall clock
//! `slack` after it would have ended unstarved (every wait has a deadline).
//!
//! [`ProcessClock::patient`] waits for a peer's answer on the same count
//! (a daemon's wait for its Welcome).
//!
//! One clock serves any number of connections and waits: its ticker is one task,
//! started on the runtime of the first sleep that waits on it (and again if
//! that runtime ends), and sleepers are woken from one ordered map.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::time::MissedTickBehavior;

/// How often a clock ticks.
pub const TICK: Duration = Duration::from_millis(250);

/// The time this process could run since the clock was made, counted in
/// [`TICK`]s. Clones share the clock.
#[derive(Clone)]
pub struct ProcessClock {
    inner: Arc<Inner>,
}

struct Inner {
    /// What `now()` counts from.
    start: Instant,
    /// Ticks counted so far.
    ticks: AtomicU64,
    /// Whether a ticker task runs for this clock.
    ticking: AtomicBool,
    /// Sleepers by (due tick, id).
    sleepers: Mutex<BTreeMap<(u64, u64), Waker>>,
    next_id: AtomicU64,
    /// How long past its unstarved end a sleep may last on the wall clock.
    slack: Duration,
}

impl std::fmt::Debug for ProcessClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessClock")
            .field("ticks", &self.ticks())
            .field("slack", &self.inner.slack)
            .finish()
    }
}

impl ProcessClock {
    /// A clock whose sleeps last at most `slack` of wall time longer than
    /// they would in a process that runs freely. No task starts until a
    /// sleep waits on it, so a clock may be made outside a runtime.
    pub fn new(slack: Duration) -> ProcessClock {
        ProcessClock {
            inner: Arc::new(Inner {
                start: Instant::now(),
                ticks: AtomicU64::new(0),
                ticking: AtomicBool::new(false),
                sleepers: Mutex::new(BTreeMap::new()),
                next_id: AtomicU64::new(0),
                slack,
            }),
        }
    }

    /// Ticks counted so far.
    pub fn ticks(&self) -> u64 {
        self.inner.ticks.load(Ordering::Acquire)
    }

    /// The time counted so far, as an instant: the clock's start plus every
    /// tick counted.
    pub fn now(&self) -> Instant {
        self.inner.start + ticks_to_duration(self.ticks())
    }

    /// A sleep that ends once `d` of this process's time has been counted
    /// (at least one tick for any `d` above zero), or `d + slack` of wall
    /// time has passed.
    pub fn sleep(&self, d: Duration) -> ProcessSleep {
        self.sleep_at_most(d, d + self.inner.slack)
    }

    /// A sleep that ends once `d` of this process's time has been counted,
    /// or `most` of wall time has passed.
    fn sleep_at_most(&self, d: Duration, most: Duration) -> ProcessSleep {
        let due = self.ticks() + ticks_for(d);
        ProcessSleep {
            inner: self.inner.clone(),
            due,
            id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
            registered: false,
            waker: None,
            most: Most {
                at: Instant::now() + most,
                timer: None,
            },
        }
    }

    /// A sleep until `deadline` on this clock (an instant from [`Self::now`]).
    pub fn sleep_until(&self, deadline: Instant) -> ProcessSleep {
        self.sleep(deadline.saturating_duration_since(self.now()))
    }

    /// `f`'s output, or [`GaveUp`] once `limit` of this process's time has
    /// been counted without it, or `most` of wall time has passed: a wait
    /// for a peer that a busy process cannot mistake for a silent peer
    /// (`tokio::time::timeout` would give up on an answer that sits unread
    /// while the process waits for a core).
    pub async fn patient<F: Future>(
        &self,
        limit: Duration,
        most: Duration,
        f: F,
    ) -> Result<F::Output, GaveUp> {
        let start = Instant::now();
        let from = self.ticks();
        let sleep = self.sleep_at_most(limit, most);
        tokio::pin!(f, sleep);
        tokio::select! {
            // The answer first: one that arrived while this process waited
            // for a core is taken even when the clock is also due.
            biased;
            out = &mut f => Ok(out),
            () = &mut sleep => Err(GaveUp {
                counted: ticks_to_duration(self.ticks().saturating_sub(from)),
                waited: start.elapsed(),
            }),
        }
    }
}

/// Why [`ProcessClock::patient`] gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GaveUp {
    /// The time counted while this process ran.
    pub counted: Duration,
    /// The wall time waited.
    pub waited: Duration,
}

impl Inner {
    /// Starts the ticker on the current runtime unless one runs.
    fn ensure_ticking(self: &Arc<Self>) {
        if self.ticking.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.ticking.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak = Arc::downgrade(self);
        runtime.spawn(tick(weak.clone(), Stopped(weak)));
    }

    /// Counts one tick and wakes every sleeper now due.
    fn advance(&self) {
        let now = self.ticks.fetch_add(1, Ordering::AcqRel) + 1;
        let due: Vec<Waker> = {
            let mut sleepers = self.sleepers.lock().expect("sleepers lock");
            let later = sleepers.split_off(&(now + 1, 0));
            std::mem::replace(&mut *sleepers, later)
                .into_values()
                .collect()
        };
        for w in due {
            w.wake();
        }
    }
}

/// Clears the clock's `ticking` when its ticker ends (its runtime shut
/// down), so that the next sleep starts another.
struct Stopped(Weak<Inner>);

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            inner.ticking.store(false, Ordering::Release);
        }
    }
}

/// The ticker: one tick per wake, however late; it ends with the clock.
async fn tick(clock: Weak<Inner>, _stopped: Stopped) {
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + TICK, TICK);
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        match clock.upgrade() {
            Some(inner) => inner.advance(),
            None => return,
        }
    }
}

fn ticks_for(d: Duration) -> u64 {
    let tick = TICK.as_nanos();
    d.as_nanos().div_ceil(tick) as u64
}

fn ticks_to_duration(ticks: u64) -> Duration {
    TICK.saturating_mul(u32::try_from(ticks).unwrap_or(u32::MAX))
}

/// A sleep on a [`ProcessClock`].
pub struct ProcessSleep {
    inner: Arc<Inner>,
    due: u64,
    id: u64,
    registered: bool,
    /// The waker last registered, to tell whether a poll must register again.
    waker: Option<Waker>,
    most: Most,
}

/// A sleep's end on the wall clock: its instant, and the timer made for it
/// when the sleep is first polled (inside a runtime).
struct Most {
    at: Instant,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Most {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let at = self.at;
        self.timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at.into())))
            .as_mut()
            .poll(cx)
    }
}

impl ProcessSleep {
    fn forget(&mut self) {
        if self.registered {
            self.registered = false;
            self.inner
                .sleepers
                .lock()
                .expect("sleepers lock")
                .remove(&(self.due, self.id));
        }
    }
}

impl Future for ProcessSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        if this.inner.ticks.load(Ordering::Acquire) >= this.due || this.most.poll(cx).is_ready() {
            this.forget();
            return Poll::Ready(());
        }
        // Registered already with a waker that wakes this task: the tick
        // that makes it due wakes it, so nothing to lock.
        if this.registered && this.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            return Poll::Pending;
        }
        this.inner.ensure_ticking();
        {
            let mut sleepers = this.inner.sleepers.lock().expect("sleepers lock");
            // Checked again under the lock: a tick counted since the check
            // above has already taken the sleepers it found due.
            if this.inner.ticks.load(Ordering::Acquire) >= this.due {
                sleepers.remove(&(this.due, this.id));
                this.registered = false;
                return Poll::Ready(());
            }
            sleepers.insert((this.due, this.id), cx.waker().clone());
            this.registered = true;
            this.waker = Some(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl Drop for ProcessSleep {
    fn drop(&mut self) {
        self.forget();
    }
}

impl hyper::rt::Sleep for ProcessSleep {}

impl hyper::rt::Timer for ProcessClock {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(ProcessClock::sleep(self, duration))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(ProcessClock::sleep_until(self, deadline))
    }

    fn now(&self) -> Instant {
        ProcessClock::now(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Holds the runtime's only thread a second at a time, as a process
    /// short of cores is held.
    async fn hog() {
        loop {
            std::thread::sleep(Duration::from_millis(1000));
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_silent_peer_is_given_up_on_after_the_limit_when_the_process_runs_freely() {
        let clock = ProcessClock::new(Duration::from_secs(30));
        let t = Instant::now();
        let r = clock
            .patient(
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
        // Another task holds the only thread most of the time: the wall
        // clock runs, the process clock mostly does not.
        let clock = ProcessClock::new(Duration::from_secs(30));
        let hog = tokio::spawn(hog());
        let t = Instant::now();
        let r = clock
            .patient(
                Duration::from_secs(1),
                Duration::from_secs(6),
                std::future::pending::<()>(),
            )
            .await;
        let patient_waited = t.elapsed();
        // A plain timeout of the same limit, as starved, gives up as soon
        // as the process runs after the limit: what sent nodes into a
        // reconnect spiral.
        let t = Instant::now();
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
        let clock = ProcessClock::new(Duration::from_secs(30));
        let hog = tokio::spawn(hog());
        // The answer is due after 1.5 s of wall time, past the 1 s limit of
        // a plain timeout; the starved process still takes it.
        let answer = tokio::time::sleep(Duration::from_millis(1500));
        let r = clock
            .patient(Duration::from_secs(1), Duration::from_secs(10), answer)
            .await;
        hog.abort();
        assert!(r.is_ok(), "{r:?}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_sleep_in_a_free_process_ends_on_time() {
        let clock = ProcessClock::new(Duration::from_secs(30));
        let t = Instant::now();
        clock.sleep(Duration::from_secs(1)).await;
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(2),
            "{took:?}"
        );
        assert!(clock.ticks() >= 4, "{clock:?}");
        // now() moved with the ticks, not with the wall clock's lateness.
        assert_eq!(clock.now(), clock.inner.start + TICK * clock.ticks() as u32);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_starved_process_sleeps_longer_but_not_past_its_slack() {
        let clock = ProcessClock::new(Duration::from_secs(5));
        let hog = tokio::spawn(hog());
        let t = Instant::now();
        clock.sleep(Duration::from_secs(1)).await;
        let took = t.elapsed();
        // A plain sleep of the same length ends as soon as the process
        // runs after it.
        let t = Instant::now();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let plain = t.elapsed();
        hog.abort();
        assert!(
            took > Duration::from_millis(2500) && took > plain,
            "four ticks, each a wake a second apart: {took:?} (plain {plain:?})"
        );
        assert!(took < Duration::from_secs(7), "1 s + 5 s slack: {took:?}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn many_sleepers_share_one_ticker_and_a_dropped_one_is_forgotten() {
        let clock = ProcessClock::new(Duration::from_secs(30));
        let dropped = clock.sleep(Duration::from_secs(60));
        {
            let mut dropped = Box::pin(dropped);
            assert!(futures_poll_once(dropped.as_mut()).await.is_pending());
        }
        let sleeps: Vec<_> = (1..=8)
            .map(|i| clock.sleep(Duration::from_millis(100 * i)))
            .collect();
        for s in sleeps {
            s.await;
        }
        assert!(
            clock.inner.sleepers.lock().unwrap().is_empty(),
            "the dropped sleep left its waker behind"
        );
    }

    #[test]
    fn a_clock_whose_runtime_ended_ticks_again_on_the_next() {
        let clock = ProcessClock::new(Duration::from_secs(30));
        for _ in 0..2 {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            let before = clock.ticks();
            rt.block_on(clock.sleep(Duration::from_millis(300)));
            assert!(clock.ticks() > before, "{clock:?}");
        }
    }

    async fn futures_poll_once<F: Future + Unpin>(mut f: F) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut f).poll(cx))).await
    }
}
