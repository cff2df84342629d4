//! How often and how far apart a delivery is attempted: exponential backoff
//! with jitter, bounded in attempts.
//!
//! The delay before attempt `n + 1` (after `n` failures) is
//! `min(max_delay, initial_delay · 2^(n-1))`, scaled by a random factor in
//! `[0.5, 1.0)` so that many deliveries failing together (a provisioner
//! outage) do not retry in lockstep. [`RetryPolicy::delay_after`] takes the
//! factor as an argument, so the schedule is testable without randomness.

use rand::Rng;
use std::time::Duration;

/// The retry schedule of one delivery target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (≥ 1).
    pub max_attempts: u32,
    pub initial_delay: Duration,
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    /// 5 attempts, 1 s doubling up to 30 s (at most about 15 s of waiting
    /// in all, plus the attempts themselves).
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// The wait after `failures` failed attempts (≥ 1), given a jitter
    /// factor in `[0, 1]` (mapped onto `[0.5, 1.0]` of the full delay).
    pub fn delay_after(&self, failures: u32, jitter: f64) -> Duration {
        let exp = failures.saturating_sub(1).min(31);
        let full = self
            .initial_delay
            .saturating_mul(1u32 << exp)
            .min(self.max_delay);
        full.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
    }

    /// [`Self::delay_after`] with a random jitter.
    pub fn jittered_delay_after(&self, failures: u32) -> Duration {
        self.delay_after(failures, rand::thread_rng().gen::<f64>())
    }

    /// Whether another attempt follows `attempts` made so far.
    pub fn should_retry(&self, attempts: u32) -> bool {
        attempts < self.max_attempts.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_with_jitter_in_the_upper_half() {
        let p = RetryPolicy {
            max_attempts: 10,
            initial_delay: Duration::from_millis(100),
            max_delay: Duration::from_millis(1000),
        };
        let full: Vec<_> = (1..=6).map(|n| p.delay_after(n, 1.0).as_millis()).collect();
        assert_eq!(full, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(p.delay_after(3, 0.0), Duration::from_millis(200));
        assert_eq!(p.delay_after(200, 0.0), Duration::from_millis(500));
        for n in 1..8 {
            let d = p.jittered_delay_after(n);
            assert!(d >= p.delay_after(n, 0.0) && d <= p.delay_after(n, 1.0));
        }
    }

    #[test]
    fn attempts_are_bounded() {
        let p = RetryPolicy {
            max_attempts: 3,
            ..RetryPolicy::default()
        };
        assert!(p.should_retry(1) && p.should_retry(2) && !p.should_retry(3));
        let once = RetryPolicy {
            max_attempts: 0,
            ..p
        };
        assert!(!once.should_retry(1));
    }
}
