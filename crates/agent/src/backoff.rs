//! Reconnect policy.
//!
//! KiCI's agent waits `1000 ms × 1.5^attempt × (1 + rand·0.5)`, capped at
//! `KICI_AGENT_MAX_RECONNECT_DELAY_MS` (default 60 s), and retries forever.
//! An ephemeral agent that cannot reach its gateway is useless, and the
//! scaler destroys an agent that has not registered within its
//! registration timeout (120 s by default), so this agent keeps KiCI's
//! curve but bounds it: it gives up after [`MAX_ATTEMPTS`] consecutive
//! failed attempts, or when the next attempt would start later than its
//! time budget allows:
//!
//! - before it ever registered, [`MAX_UNREGISTERED`] from its start (the
//!   gateway may still be coming up);
//! - after a registered connection was lost, [`MAX_AFTER_LOSS`] from the
//!   first failed attempt. A lost connection already killed any running
//!   job, so the agent has nothing left to finish; a gateway that stays
//!   away that long is gone (its daemon was killed, or its `run` ended),
//!   and a restarted daemon is back well within it.
//!
//! Both budgets reset on every `register.ack`.

use rand::Rng;
use std::time::Duration;
use tokio::time::Instant;

pub const BASE_DELAY: Duration = Duration::from_millis(1000);
pub const FACTOR: f64 = 1.5;
pub const MAX_ATTEMPTS: u32 = 12;
pub const MAX_UNREGISTERED: Duration = Duration::from_secs(180);
pub const MAX_AFTER_LOSS: Duration = Duration::from_secs(45);

#[derive(Debug)]
pub struct Backoff {
    cap: Duration,
    failed_attempts: u32,
    since: Instant,
    budget: Duration,
    /// Registered since the last failure: the next failure starts the
    /// after-loss budget.
    registered: bool,
}

impl Backoff {
    pub fn new(cap: Duration) -> Self {
        Self {
            cap,
            failed_attempts: 0,
            since: Instant::now(),
            budget: MAX_UNREGISTERED,
            registered: false,
        }
    }

    /// Registered: start both budgets afresh.
    pub fn reset(&mut self) {
        self.failed_attempts = 0;
        self.since = Instant::now();
        self.registered = true;
    }

    /// Records a failed attempt; the delay before the next one, or `None`
    /// when a budget is spent.
    pub fn next_delay(&mut self) -> Option<Duration> {
        if self.registered {
            self.registered = false;
            self.since = Instant::now();
            self.budget = MAX_AFTER_LOSS;
        }
        let exponent = i32::try_from(self.failed_attempts).unwrap_or(i32::MAX);
        self.failed_attempts = self.failed_attempts.saturating_add(1);
        if self.failed_attempts > MAX_ATTEMPTS {
            return None;
        }
        let jitter = 1.0 + rand::thread_rng().gen::<f64>() * 0.5;
        let raw = BASE_DELAY.as_secs_f64() * FACTOR.powi(exponent) * jitter;
        let delay = Duration::try_from_secs_f64(raw)
            .unwrap_or(self.cap)
            .min(self.cap);
        (self.since.elapsed() + delay <= self.budget).then_some(delay)
    }

    pub fn failed_attempts(&self) -> u32 {
        self.failed_attempts
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn follows_the_capped_curve_and_stops_after_the_attempt_budget() {
        let mut b = Backoff::new(Duration::from_secs(60));
        let delays: Vec<Duration> = std::iter::from_fn(|| b.next_delay()).collect();
        assert_eq!(delays.len(), MAX_ATTEMPTS as usize);
        for (i, d) in delays.iter().enumerate() {
            let nominal = 1.5f64.powi(i as i32);
            let lo = Duration::from_secs_f64(nominal).min(Duration::from_secs(60));
            let hi = Duration::from_secs_f64(nominal * 1.5).min(Duration::from_secs(60));
            assert!(
                *d >= lo && *d <= hi,
                "attempt {i}: {d:?} not in {lo:?}..={hi:?}"
            );
        }
        b.reset();
        assert_eq!(b.failed_attempts(), 0);
        assert!(b.next_delay().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_lost_registration_it_gives_up_within_the_after_loss_budget() {
        let mut b = Backoff::new(Duration::from_secs(60));
        b.reset();
        // Registered for a long time before the connection is lost: the
        // budget counts from the loss, not from the registration.
        tokio::time::advance(Duration::from_secs(3600)).await;
        let mut waited = Duration::ZERO;
        while let Some(d) = b.next_delay() {
            tokio::time::advance(d).await;
            waited += d;
        }
        assert!(waited > Duration::ZERO, "it never retried");
        assert!(
            waited <= MAX_AFTER_LOSS,
            "retried for {waited:?}, past {MAX_AFTER_LOSS:?}"
        );
        assert!(
            b.failed_attempts() < MAX_ATTEMPTS,
            "the time budget, not the attempt budget, ended it"
        );
    }

    #[test]
    fn the_cap_bounds_every_delay() {
        let mut b = Backoff::new(Duration::from_millis(20));
        while let Some(d) = b.next_delay() {
            assert!(d <= Duration::from_millis(20));
        }
        assert_eq!(b.failed_attempts(), MAX_ATTEMPTS + 1);
    }
}
