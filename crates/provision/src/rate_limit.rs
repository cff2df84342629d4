//! A token-bucket rate limiter per key (the claim endpoint keys it by the
//! source address), pure: the caller passes `now`, nothing here reads a
//! clock or spawns a task.
//!
//! Each key has a bucket of `burst` tokens, refilled at one token per
//! `refill_every`; a request takes one token or is refused with how long
//! until one is back. The number of keys tracked is bounded: when a new key
//! would exceed `max_keys`, buckets that are full again (they hold no
//! information) are dropped, and if none is, the least recently used one.
//! An attacker cycling source addresses can therefore only make buckets
//! forget — which is why the limit also holds per code (single use) and the
//! code space is 256 bits.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::{IpAddr, Ipv6Addr};
use std::time::{Duration, Instant};

/// The key a source address is limited under: an IPv4 address as is (an
/// IPv4-mapped IPv6 one as its IPv4), an IPv6 address by its /64 — one host
/// usually has a whole /64 to pick addresses from.
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// The limiter's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Tokens a fresh key starts with (the burst allowed at once).
    pub burst: u32,
    /// One token comes back per this interval.
    pub refill_every: Duration,
    /// Keys tracked at most.
    pub max_keys: usize,
}

impl Default for RateLimit {
    /// 10 at once, then one every 6 s (10 a minute), 65 536 addresses.
    fn default() -> Self {
        Self {
            burst: 10,
            refill_every: Duration::from_secs(6),
            max_keys: 65_536,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Whole tokens available at `stamp`.
    tokens: u32,
    /// When `tokens` was last true; refills count from here.
    stamp: Instant,
    last_used: Instant,
}

/// Refused: try again after this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("rate limited; retry after {retry_after:?}")]
pub struct Limited {
    pub retry_after: Duration,
}

/// Per-key token buckets.
#[derive(Debug)]
pub struct RateLimiter<K> {
    limit: RateLimit,
    buckets: HashMap<K, Bucket>,
}

impl<K: Eq + Hash + Clone> RateLimiter<K> {
    /// A zero `burst` or `refill_every` is raised to 1 (a limiter that
    /// refuses everything, or refills infinitely fast, is not a setting).
    pub fn new(mut limit: RateLimit) -> Self {
        limit.burst = limit.burst.max(1);
        limit.refill_every = limit.refill_every.max(Duration::from_millis(1));
        limit.max_keys = limit.max_keys.max(1);
        Self {
            limit,
            buckets: HashMap::new(),
        }
    }

    /// Takes a token for `key` at `now`, or says how long until one is back.
    pub fn check(&mut self, key: &K, now: Instant) -> Result<(), Limited> {
        if !self.buckets.contains_key(key) {
            self.make_room(now);
            self.buckets.insert(
                key.clone(),
                Bucket {
                    tokens: self.limit.burst,
                    stamp: now,
                    last_used: now,
                },
            );
        }
        let limit = self.limit;
        let Some(bucket) = self.buckets.get_mut(key) else {
            // Inserted just above; unreachable, refused rather than panicking.
            return Err(Limited {
                retry_after: limit.refill_every,
            });
        };
        refill(bucket, &limit, now);
        bucket.last_used = bucket.last_used.max(now);
        if bucket.tokens == 0 {
            let since = now.saturating_duration_since(bucket.stamp);
            return Err(Limited {
                retry_after: limit.refill_every.saturating_sub(since),
            });
        }
        if bucket.tokens == limit.burst {
            // A full bucket's refill clock starts when it is first drawn on.
            bucket.stamp = now;
        }
        bucket.tokens -= 1;
        Ok(())
    }

    /// Whether `key` has a token at `now`, without taking it (for a budget
    /// drawn on only by requests that turn out to fail).
    pub fn peek(&mut self, key: &K, now: Instant) -> Result<(), Limited> {
        let limit = self.limit;
        let Some(bucket) = self.buckets.get_mut(key) else {
            return Ok(());
        };
        refill(bucket, &limit, now);
        if bucket.tokens == 0 {
            let since = now.saturating_duration_since(bucket.stamp);
            return Err(Limited {
                retry_after: limit.refill_every.saturating_sub(since),
            });
        }
        Ok(())
    }

    /// How many keys are tracked.
    pub fn tracked(&self) -> usize {
        self.buckets.len()
    }

    fn make_room(&mut self, now: Instant) {
        if self.buckets.len() < self.limit.max_keys {
            return;
        }
        let limit = self.limit;
        self.buckets.retain(|_, b| {
            refill(b, &limit, now);
            b.tokens < limit.burst
        });
        while self.buckets.len() >= self.limit.max_keys {
            let Some(oldest) = self
                .buckets
                .iter()
                .min_by_key(|(_, b)| b.last_used)
                .map(|(k, _)| k.clone())
            else {
                return;
            };
            self.buckets.remove(&oldest);
        }
    }
}

/// Adds the tokens earned since `stamp`, advancing `stamp` by whole
/// intervals only (the fraction carries over).
fn refill(bucket: &mut Bucket, limit: &RateLimit, now: Instant) {
    if bucket.tokens >= limit.burst {
        return;
    }
    let elapsed = now.saturating_duration_since(bucket.stamp);
    let every = limit.refill_every.as_nanos().max(1);
    let earned = elapsed.as_nanos() / every;
    if earned == 0 {
        return;
    }
    let room = u128::from(limit.burst - bucket.tokens);
    let add = earned.min(room);
    // `add` ≤ room ≤ burst, a u32.
    bucket.tokens += u32::try_from(add).unwrap_or(0);
    if bucket.tokens >= limit.burst {
        bucket.stamp = now;
    } else {
        // add < earned's u128 range only matters when full (handled above).
        let step = u64::try_from(add * every).unwrap_or(u64::MAX);
        bucket.stamp += Duration::from_nanos(step);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(burst: u32, secs: u64, max_keys: usize) -> RateLimit {
        RateLimit {
            burst,
            refill_every: Duration::from_secs(secs),
            max_keys,
        }
    }

    #[test]
    fn peek_never_takes_a_token() {
        let mut l = RateLimiter::new(limit(2, 10, 4));
        let t0 = Instant::now();
        assert!(l.peek(&"k", t0).is_ok(), "an unknown key has its burst");
        for _ in 0..5 {
            assert!(l.peek(&"k", t0).is_ok());
        }
        l.check(&"k", t0).unwrap();
        l.check(&"k", t0).unwrap();
        let refused = l.peek(&"k", t0 + Duration::from_secs(4)).unwrap_err();
        assert_eq!(refused.retry_after, Duration::from_secs(6));
        assert!(l.peek(&"k", t0 + Duration::from_secs(10)).is_ok());
        l.check(&"k", t0 + Duration::from_secs(10)).unwrap();
    }

    #[test]
    fn burst_then_one_per_interval() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(limit(3, 10, 100));
        for _ in 0..3 {
            assert_eq!(rl.check(&"a", t0), Ok(()));
        }
        assert_eq!(
            rl.check(&"a", t0 + Duration::from_secs(4)),
            Err(Limited {
                retry_after: Duration::from_secs(6)
            })
        );
        // Another key is not affected.
        assert_eq!(rl.check(&"b", t0), Ok(()));
        assert_eq!(rl.check(&"a", t0 + Duration::from_secs(10)), Ok(()));
        assert!(rl.check(&"a", t0 + Duration::from_secs(11)).is_err());
        // The fraction carried: the next token is at 20 s, not 21 s.
        assert_eq!(rl.check(&"a", t0 + Duration::from_secs(20)), Ok(()));
        // A long pause refills up to the burst, no more.
        let later = t0 + Duration::from_secs(1000);
        for _ in 0..3 {
            assert_eq!(rl.check(&"a", later), Ok(()));
        }
        assert!(rl.check(&"a", later).is_err());
    }

    #[test]
    fn key_count_is_bounded_and_full_buckets_go_first() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(limit(2, 10, 3));
        rl.check(&1, t0).unwrap();
        rl.check(&1, t0).unwrap();
        rl.check(&2, t0 + Duration::from_secs(1)).unwrap();
        rl.check(&3, t0 + Duration::from_secs(2)).unwrap();
        // Key 4 evicts the least recently used (1) as none is full yet.
        rl.check(&4, t0 + Duration::from_secs(3)).unwrap();
        assert_eq!(rl.tracked(), 3);
        // Much later every bucket is full again: all are dropped for room.
        rl.check(&5, t0 + Duration::from_secs(100)).unwrap();
        assert_eq!(rl.tracked(), 1);
    }

    #[test]
    fn source_keys_group_an_ipv6_host_and_unmap_ipv4() {
        let k = |s: &str| source_key(s.parse().unwrap()).to_string();
        assert_eq!(k("192.0.2.7"), "192.0.2.7");
        assert_eq!(k("::ffff:192.0.2.7"), "192.0.2.7");
        assert_eq!(k("2001:db8:1:2:aaaa::1"), "2001:db8:1:2::");
        assert_eq!(k("2001:db8:1:2:ffff::9"), "2001:db8:1:2::");
    }

    #[test]
    fn an_evicted_key_starts_over_with_a_full_burst() {
        let t0 = Instant::now();
        let mut rl = RateLimiter::new(limit(1, 60, 1));
        rl.check(&"a", t0).unwrap();
        assert!(rl.check(&"a", t0).is_err());
        rl.check(&"b", t0).unwrap();
        rl.check(&"a", t0).unwrap();
    }
}
