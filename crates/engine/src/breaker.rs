//! Per-label-set spawn backoff and circuit breaker.
//!
//! Upstream retries nothing and so either starves jobs or, with naive
//! retries, hammers a broken image or host. Here each label set has its own
//! [`Breaker`]: after a failure the next spawn waits `initial × 2^(n-1)`
//! (capped at `max`); after `breaker_threshold` consecutive failures the
//! breaker opens for `breaker_open`, then lets exactly one probe through
//! (half-open); a success closes it.

use kici_model::BackoffPolicy;
use std::time::{Duration, Instant};

/// The breaker state shown in status and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half-open",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Breaker {
    policy: BackoffPolicy,
    consecutive_failures: u32,
    /// No spawn before this instant (backoff, or the open period).
    not_before: Option<Instant>,
    open: bool,
    probe_in_flight: bool,
}

impl Breaker {
    pub fn new(policy: BackoffPolicy) -> Self {
        Self {
            policy,
            consecutive_failures: 0,
            not_before: None,
            open: false,
            probe_in_flight: false,
        }
    }

    /// Reload: keep the history, apply the new policy from now on.
    pub fn set_policy(&mut self, policy: BackoffPolicy) {
        self.policy = policy;
    }

    pub fn state(&self, now: Instant) -> BreakerState {
        if !self.open {
            BreakerState::Closed
        } else if self.not_before.is_some_and(|t| now < t) {
            BreakerState::Open
        } else {
            BreakerState::HalfOpen
        }
    }

    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }

    /// May a spawn start now? `Err(at)` says when to ask again (`None`: when
    /// the in-flight half-open probe settles).
    pub fn check(&self, now: Instant) -> Result<(), Option<Instant>> {
        if let Some(t) = self.not_before {
            if now < t {
                return Err(Some(t));
            }
        }
        if self.open && self.probe_in_flight {
            return Err(None);
        }
        Ok(())
    }

    /// Records that a spawn started (after a successful [`Breaker::check`]).
    pub fn on_attempt(&mut self, now: Instant) {
        if self.state(now) == BreakerState::HalfOpen {
            self.probe_in_flight = true;
        }
    }

    pub fn on_success(&mut self) {
        self.consecutive_failures = 0;
        self.not_before = None;
        self.open = false;
        self.probe_in_flight = false;
    }

    pub fn on_failure(&mut self, now: Instant) {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.probe_in_flight = false;
        if self.open || self.consecutive_failures >= self.policy.breaker_threshold {
            self.open = true;
            self.not_before = Some(now + self.policy.breaker_open);
        } else {
            self.not_before = Some(now + self.delay(self.consecutive_failures));
        }
    }

    /// `initial × 2^(n-1)`, capped at `max`.
    fn delay(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(31);
        self.policy
            .initial
            .checked_mul(1u32 << exp)
            .map_or(self.policy.max, |d| d.min(self.policy.max))
    }

    /// The next instant at which this breaker's answer changes, if any.
    pub fn next_change(&self, now: Instant) -> Option<Instant> {
        self.not_before.filter(|t| *t > now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> BackoffPolicy {
        BackoffPolicy {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(8),
            breaker_threshold: 5,
            breaker_open: Duration::from_secs(60),
        }
    }

    #[test]
    fn backs_off_exponentially_with_a_cap() {
        let t0 = Instant::now();
        let mut b = Breaker::new(policy());
        assert_eq!(b.check(t0), Ok(()));
        let mut now = t0;
        for expected in [1, 2, 4, 8] {
            b.on_failure(now);
            assert_eq!(b.check(now), Err(Some(now + Duration::from_secs(expected))));
            assert_eq!(b.state(now), BreakerState::Closed);
            now += Duration::from_secs(expected);
            assert_eq!(b.check(now), Ok(()));
        }
        // Capped: a higher policy threshold would keep 8 s.
        let mut capped = Breaker::new(BackoffPolicy {
            breaker_threshold: 100,
            ..policy()
        });
        for _ in 0..10 {
            capped.on_failure(t0);
        }
        assert_eq!(capped.check(t0), Err(Some(t0 + Duration::from_secs(8))));
    }

    #[test]
    fn opens_after_threshold_then_half_open_probe() {
        let t0 = Instant::now();
        let mut b = Breaker::new(policy());
        for _ in 0..5 {
            b.on_failure(t0);
        }
        assert_eq!(b.state(t0), BreakerState::Open);
        assert_eq!(b.check(t0), Err(Some(t0 + Duration::from_secs(60))));
        let t1 = t0 + Duration::from_secs(60);
        assert_eq!(b.state(t1), BreakerState::HalfOpen);
        assert_eq!(b.check(t1), Ok(()));
        b.on_attempt(t1);
        // Only one probe at a time.
        assert_eq!(b.check(t1), Err(None));
        // A failed probe re-opens for the full period.
        b.on_failure(t1);
        assert_eq!(b.state(t1), BreakerState::Open);
        let t2 = t1 + Duration::from_secs(60);
        b.on_attempt(t2);
        b.on_success();
        assert_eq!(b.state(t2), BreakerState::Closed);
        assert_eq!(b.check(t2), Ok(()));
        assert_eq!(b.consecutive_failures(), 0);
    }
}
