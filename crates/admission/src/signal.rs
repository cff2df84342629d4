//! "Capacity was released": a generation counter that every release (and
//! every reconfiguration, which may raise caps) bumps, observable without a
//! runtime — poll it, block on it, or await it.
//!
//! The engine keeps refused requests pending and retries them when this
//! fires, so pending requests are woken by events, never by polling timers.

use crate::sync::{lock, Arc, AtomicU64, Condvar, Mutex, Ordering};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

#[derive(Debug)]
pub(crate) struct SignalShared {
    generation: AtomicU64,
    /// The generation is bumped and checked under this lock, so a waiter
    /// cannot miss a bump between its check and its registration.
    waiters: Mutex<Waiters>,
    condvar: Condvar,
}

#[derive(Debug, Default)]
struct Waiters {
    wakers: Vec<Waker>,
    /// Threads blocked in `wait_timeout`: without any, a release skips the
    /// condvar (a futex wake system call) entirely.
    blocked: usize,
}

impl SignalShared {
    pub(crate) fn new() -> Self {
        Self {
            generation: AtomicU64::new(0),
            waiters: Mutex::new(Waiters::default()),
            condvar: Condvar::new(),
        }
    }

    pub(crate) fn bump(&self) {
        let (wakers, blocked) = {
            let mut waiters = lock(&self.waiters);
            self.generation.fetch_add(1, Ordering::AcqRel);
            (std::mem::take(&mut waiters.wakers), waiters.blocked)
        };
        if blocked > 0 {
            self.condvar.notify_all();
        }
        for waker in wakers {
            waker.wake();
        }
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
}

/// A subscription to releases. It remembers the generation it last saw;
/// every method reports releases that happened after that point, so
/// subscribe (or observe) *before* trying to admit, then wait: a release in
/// between is never lost.
#[derive(Debug, Clone)]
pub struct ReleaseSignal {
    shared: Arc<SignalShared>,
    seen: u64,
}

impl ReleaseSignal {
    pub(crate) fn new(shared: Arc<SignalShared>) -> Self {
        let seen = shared.generation();
        Self { shared, seen }
    }

    /// The current generation (increments on every release).
    pub fn generation(&self) -> u64 {
        self.shared.generation()
    }

    /// True when capacity was released since this subscription last
    /// observed; marks the current generation as seen. Cheap (one atomic load).
    pub fn take_released(&mut self) -> bool {
        let now = self.shared.generation();
        let changed = now != self.seen;
        self.seen = now;
        changed
    }

    /// Waits (async) until capacity is released after the last observation.
    /// Works on any executor; needs no runtime.
    pub fn released(&mut self) -> Released<'_> {
        Released { signal: self }
    }

    /// Blocks the calling thread until a release after the last observation
    /// or until `timeout`; returns whether a release happened.
    #[cfg(not(loom))]
    pub fn wait_timeout(&mut self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut waiters = lock(&self.shared.waiters);
        loop {
            let now_gen = self.shared.generation();
            if now_gen != self.seen {
                self.seen = now_gen;
                return true;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            waiters.blocked += 1;
            waiters = match self.shared.condvar.wait_timeout(waiters, deadline - now) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
            waiters.blocked -= 1;
        }
    }
}

/// The future of [`ReleaseSignal::released`].
#[derive(Debug)]
pub struct Released<'a> {
    signal: &'a mut ReleaseSignal,
}

impl Future for Released<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let mut waiters = lock(&this.signal.shared.waiters);
        let now = this.signal.shared.generation();
        if now != this.signal.seen {
            this.signal.seen = now;
            return Poll::Ready(());
        }
        if !waiters.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            waiters.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::task::Wake;
    use std::time::Duration;

    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn poll_and_future_see_bumps_after_subscription_only() {
        let shared = Arc::new(SignalShared::new());
        shared.bump();
        let mut sig = ReleaseSignal::new(shared.clone());
        assert!(
            !sig.take_released(),
            "a bump before subscribing is not reported"
        );

        let flag = std::sync::Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        {
            let mut fut = sig.released();
            assert!(Pin::new(&mut fut).poll(&mut cx).is_pending());
            shared.bump();
            assert!(flag.0.load(Ordering::SeqCst), "the bump woke the waiter");
            assert!(Pin::new(&mut fut).poll(&mut cx).is_ready());
        }
        assert!(!sig.take_released(), "the future consumed the bump");
        shared.bump();
        assert!(sig.take_released());
        shared.bump();
        assert!(sig.wait_timeout(Duration::ZERO), "already bumped: no wait");
        assert!(!sig.wait_timeout(Duration::ZERO));
    }

    #[test]
    fn blocking_wait_wakes_on_bump_from_another_thread() {
        let shared = Arc::new(SignalShared::new());
        let mut sig = ReleaseSignal::new(shared.clone());
        let bumper = std::thread::spawn(move || shared.bump());
        // A generous bound: the wait returns as soon as the bump lands.
        assert!(sig.wait_timeout(Duration::from_secs(60)));
        bumper.join().unwrap();
    }
}
