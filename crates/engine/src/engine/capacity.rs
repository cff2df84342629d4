//! Warm pool targets that change with time (`x-kici-scaler.warmPool`): a
//! weekly schedule of periods, read against the wall clock the embedding
//! program passes in ([`Engine::set_wall_clock`]), and a forecast of each
//! label set's demand from its own recent arrivals. Both are recomputed on
//! a timer (every [`PLAN_EVERY`]) and on reload; between two plans the
//! target stays put, so the pool never chases single requests.
//!
//! The forecast, per label set, at each plan:
//!
//! - `lead` = the scaler's observed spawn time (spawn → registered, a
//!   moving average of its agents; [`DEFAULT_LEAD`] before the first one);
//! - `steady` = the pool a Poisson stream at the rate of the last
//!   [`RATE_WINDOW`] is worth (`m` arrivals expected per `lead`): with `k`
//!   agents warm and each taken one replaced, an arrival waits when `k` or
//!   more replacements are still spawning, so one more agent saves the
//!   arrivals that find exactly `k` spawning and idles whenever at most `k`
//!   are. Agents are added while that costs at most [`WAITS_WORTH`] spawn
//!   times of idle per wait saved. One exchange rate for every rate
//!   spends idle time where it saves the most waits: a busy stream gets a
//!   pool a few agents above its mean, a trickle of a job every few
//!   minutes gets none (a warm agent would idle minutes per wait saved) —
//!   a fixed "mean plus a deviation" overpays at both ends;
//! - `burst` = the most arrivals seen within any [`BURST_SPAN`] of the last
//!   [`BURST_WINDOW`], when that is a fan-out: a steady stream at the
//!   measured rate would put that many into some span of the window with
//!   less than a 1% chance. The test counts every span scanned (one per
//!   arrival): judged one span at a time, a busy stream's chance clumps
//!   (five jobs in ten seconds at five a minute, a few times an hour) pass
//!   for fan-outs and keep a pool sized for them warm for the whole window
//!   and hold. A pipeline that fans out into many jobs at once is likely to
//!   do so again soon;
//! - the target is `max(steady, burst)` where each is the largest of its
//!   plans over its hold (hysteresis: it rises at once and falls only after
//!   demand stayed low that long): [`HOLD`] for a fan-out, which comes back
//!   minutes later, and only [`STEADY_HOLD`] for the steady stream, whose
//!   plans move with the noise of the rate estimate — holding their maximum
//!   for long keeps the pool sized for the noise's peaks. Bounded by
//!   `minSize`, `maxSize` and `maxAgents`.
//!
//! Everything is a function of the arrivals, the registrations and the
//! instants passed in: the same history and clock give the same targets.

use super::*;
use kici_model::WarmPolicy;

/// How often targets are recomputed.
pub const PLAN_EVERY: Duration = Duration::from_secs(30);
/// The window the arrival rate is measured over.
pub const RATE_WINDOW: Duration = Duration::from_secs(15 * 60);
/// Arrivals this close together count as one burst (a fan-out).
pub const BURST_SPAN: Duration = Duration::from_secs(10);
/// How far back the largest burst is looked for.
pub const BURST_WINDOW: Duration = Duration::from_secs(30 * 60);
/// How long a fan-out's target is held before it may fall.
pub const HOLD: Duration = Duration::from_secs(10 * 60);
/// How long the steady stream's target is held before it may fall.
pub const STEADY_HOLD: Duration = Duration::from_secs(60);
/// How many spawn times of idle agent time one spawn wait saved is worth
/// (the steady stream's pool keeps an agent while it costs at most that).
pub const WAITS_WORTH: f64 = 8.0;
/// The chance below which a span's arrivals are a fan-out rather than a
/// steady stream's clump.
const BURST_CHANCE: f64 = 0.01;
/// The spawn time assumed before the scaler's first registration.
pub const DEFAULT_LEAD: Duration = Duration::from_secs(30);
/// Weight of the newest observation in the spawn time's moving average.
const LEAD_WEIGHT: f64 = 0.2;

/// Where a scaler's warm pool target comes from now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum WarmSource {
    /// Upstream's `warmPool` (or none).
    #[default]
    Static,
    /// The schedule's period `index` (`description`: its days, hours and
    /// time zone).
    Period { index: usize, description: String },
    /// The forecast.
    Forecast,
}

impl WarmSource {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Static => "static",
            Self::Period { .. } => "schedule",
            Self::Forecast => "forecast",
        }
    }
}

/// A scaler's planned targets.
#[derive(Debug, Clone)]
struct Planned {
    source: WarmSource,
    /// Per label set.
    sizes: Vec<u32>,
}

type Key = (ScalerName, LabelSet);

/// The state behind dynamic warm pool targets.
#[derive(Debug, Default)]
pub(super) struct Capacity {
    /// The wall clock at one instant of the engine's clock; later wall
    /// times are extrapolated from it.
    wall: Option<(Instant, jiff::Timestamp)>,
    next_plan: Option<Instant>,
    /// Arrivals per label set (scalers with a forecast only), oldest first.
    arrivals: HashMap<Key, VecDeque<Instant>>,
    /// Raw forecasts of the last [`HOLD`], oldest first.
    held: HashMap<Key, VecDeque<(Instant, u32, u32)>>,
    /// Spawn time per scaler, seconds.
    lead: HashMap<ScalerName, f64>,
    targets: HashMap<ScalerName, Planned>,
}

impl Capacity {
    fn wall_at(&self, now: Instant) -> Option<jiff::Timestamp> {
        let (at, wall) = self.wall?;
        let span = |d: Duration| jiff::SignedDuration::try_from(d).ok();
        if now >= at {
            wall.checked_add(span(now - at)?).ok()
        } else {
            wall.checked_sub(span(at - now)?).ok()
        }
    }

    fn lead(&self, scaler: &ScalerName) -> f64 {
        self.lead
            .get(scaler)
            .copied()
            .unwrap_or(DEFAULT_LEAD.as_secs_f64())
    }
}

fn has_policy(scaler: &ScalerEntry) -> bool {
    scaler.ext.warm_pool.is_some()
}

/// The most arrivals within any `span`-long window of the last
/// [`BURST_WINDOW`] (arrivals sorted).
fn largest_burst(arrivals: &VecDeque<Instant>, now: Instant, span: Duration) -> u32 {
    let mut best = 0usize;
    let mut start = 0usize;
    let times: Vec<Instant> = arrivals
        .iter()
        .copied()
        .filter(|t| now.saturating_duration_since(*t) < BURST_WINDOW)
        .collect();
    for end in 0..times.len() {
        while times[end].saturating_duration_since(times[start]) >= span {
            start += 1;
        }
        best = best.max(end + 1 - start);
    }
    u32::try_from(best).unwrap_or(u32::MAX)
}

/// The chance that a Poisson count of mean `mean` is at least `k`.
fn poisson_tail(mean: f64, k: u32) -> f64 {
    let mut term = (-mean).exp();
    let mut below = 0.0;
    for i in 0..k {
        below += term;
        term *= mean / f64::from(i + 1);
    }
    (1.0 - below).max(0.0)
}

/// The most agents worth keeping warm for a Poisson stream of `mean`
/// arrivals per spawn time: the (k+1)-th is kept while the idle time it
/// adds, per spawn wait it saves, is at most `c` spawn times. With `k` warm
/// and every taken agent replaced, an arrival finds the pool empty when `k`
/// or more replacements are still spawning (N ~ Poisson(mean)); one more
/// agent sits idle while N <= k and saves the waits of arrivals that find
/// exactly `k` spawning.
fn marginal_size(mean: f64, c: f64) -> u32 {
    if mean <= 0.0 {
        return 0;
    }
    let mut k = 0u32;
    let mut pk = (-mean).exp(); // P(N = k)
    let mut below = pk; // P(N <= k)
    while k < 10_000 {
        // Adding agent k+1: idle with P(N <= k), saves a wait at rate m P(N = k).
        if pk <= 0.0 || below / (mean * pk) > c {
            break;
        }
        k += 1;
        pk *= mean / f64::from(k);
        below += pk;
    }
    k
}

impl Engine {
    /// Tells the engine the wall-clock time at `now` (the schedule is read
    /// against it). The embedding program calls it before each
    /// [`Engine::tick`]; a simulation passes its virtual clock.
    pub fn set_wall_clock(&mut self, now: Instant, wall: jiff::Timestamp) {
        self.capacity.wall = Some((now, wall));
    }

    /// The warm pool target of `scaler`'s label set `label_set` now.
    pub(super) fn warm_target_of(&self, scaler: &ScalerEntry, label_set: usize) -> usize {
        let planned = self
            .capacity
            .targets
            .get(&scaler.name)
            .and_then(|p| p.sizes.get(label_set).copied());
        planned.unwrap_or_else(|| scaler.warm_target()) as usize
    }

    /// The sum of `scaler`'s label sets' targets, and where they come from.
    pub(super) fn warm_plan_of(&self, scaler: &ScalerEntry) -> (u32, WarmSource) {
        let total = (0..scaler.label_sets.len())
            .map(|li| u32::try_from(self.warm_target_of(scaler, li)).unwrap_or(u32::MAX))
            .sum();
        let source = self
            .capacity
            .targets
            .get(&scaler.name)
            .map(|p| p.source.clone())
            .unwrap_or_default();
        (total, source)
    }

    /// Whether any label set may want a warm agent (for timers).
    pub(super) fn any_warm_target(&self) -> bool {
        self.config.scalers.iter().any(|s| {
            s.warm_target() > 0
                || has_policy(s)
                || (0..s.label_sets.len()).any(|li| self.warm_target_of(s, li) > 0)
        })
    }

    /// When targets are next recomputed (some scaler has a schedule or a
    /// forecast).
    pub(super) fn next_plan(&self, now: Instant) -> Option<Instant> {
        if !self.config.scalers.iter().any(has_policy) {
            return None;
        }
        Some(self.capacity.next_plan.unwrap_or(now))
    }

    /// Records an arrival routed to `scaler`'s label set `label_set`.
    pub(super) fn record_arrival(&mut self, scaler_index: usize, label_set: usize, at: Instant) {
        let scaler = &self.config.scalers[scaler_index];
        if scaler
            .ext
            .warm_pool
            .as_ref()
            .is_none_or(|p| p.forecast.is_none())
        {
            return;
        }
        let key = (
            scaler.name.clone(),
            scaler.label_sets[label_set].labels.clone(),
        );
        let list = self.capacity.arrivals.entry(key).or_default();
        list.push_back(at);
        let keep = RATE_WINDOW.max(BURST_WINDOW);
        while list
            .front()
            .is_some_and(|t| at.saturating_duration_since(*t) > keep)
        {
            list.pop_front();
        }
    }

    /// Records how long one of `scaler`'s agents took from its creation to
    /// its registration.
    pub(super) fn record_lead(&mut self, scaler: &ScalerName, took: Duration) {
        let took = took.as_secs_f64();
        self.capacity
            .lead
            .entry(scaler.clone())
            .and_modify(|l| *l = (1.0 - LEAD_WEIGHT) * *l + LEAD_WEIGHT * took)
            .or_insert(took);
    }

    /// Recomputes every scaler's targets if the plan is due; the caller
    /// shrinks and refills the pools.
    pub(super) fn plan_if_due(&mut self, now: Instant) -> bool {
        match self.next_plan(now) {
            Some(at) if at <= now => {
                self.plan_warm(now);
                true
            }
            _ => false,
        }
    }

    /// Recomputes every scaler's targets now.
    pub(super) fn plan_warm(&mut self, now: Instant) {
        let config = Arc::clone(&self.config);
        let wall = self.capacity.wall_at(now);
        let mut targets = HashMap::new();
        for scaler in &config.scalers {
            let Some(policy) = &scaler.ext.warm_pool else {
                continue;
            };
            let planned = self.plan_scaler(scaler, policy, wall, now);
            targets.insert(scaler.name.clone(), planned);
        }
        self.capacity.targets = targets;
        // Histories of scalers that no longer forecast are dropped.
        let forecasting: HashSet<&ScalerName> = config
            .scalers
            .iter()
            .filter(|s| {
                s.ext
                    .warm_pool
                    .as_ref()
                    .is_some_and(|p| p.forecast.is_some())
            })
            .map(|s| &s.name)
            .collect();
        self.capacity
            .arrivals
            .retain(|(name, _), _| forecasting.contains(name));
        self.capacity
            .held
            .retain(|(name, _), _| forecasting.contains(name));
        self.capacity.next_plan = Some(now + PLAN_EVERY);
    }

    fn plan_scaler(
        &mut self,
        scaler: &ScalerEntry,
        policy: &WarmPolicy,
        wall: Option<jiff::Timestamp>,
        now: Instant,
    ) -> Planned {
        let n = scaler.label_sets.len();
        let cap = scaler.max_agents.min(self.config.global_max_agents);
        if let Some(index) = wall.and_then(|w| policy.active_period(w)) {
            let period = &policy.schedule[index];
            return Planned {
                source: WarmSource::Period {
                    index,
                    description: period.describe(),
                },
                sizes: vec![period.size.min(cap); n],
            };
        }
        let Some(forecast) = policy.forecast else {
            return Planned {
                source: WarmSource::Static,
                sizes: vec![scaler.warm_target().min(cap); n],
            };
        };
        let lead = self.capacity.lead(&scaler.name);
        let sizes = scaler
            .label_sets
            .iter()
            .map(|ls| {
                let key = (scaler.name.clone(), ls.labels.clone());
                let (steady, burst) = match self.capacity.arrivals.get(&key) {
                    Some(arrivals) => {
                        let recent = arrivals
                            .iter()
                            .rev()
                            .take_while(|t| now.saturating_duration_since(**t) < RATE_WINDOW)
                            .count();
                        let rate = recent as f64 / RATE_WINDOW.as_secs_f64();
                        let steady = marginal_size(rate * lead, WAITS_WORTH);
                        // A fan-out is a span holding more arrivals than a
                        // steady stream at this rate would put into any span
                        // of the window but for a 1% chance.
                        let in_window = arrivals
                            .iter()
                            .filter(|t| now.saturating_duration_since(**t) < BURST_WINDOW)
                            .count() as f64;
                        let burst = largest_burst(arrivals, now, BURST_SPAN);
                        // The stream's rate over the same window the burst
                        // was looked for in: measured over a shorter one, an
                        // old pair of jobs would pass for a fan-out once the
                        // rate window has emptied.
                        let in_span =
                            in_window / BURST_WINDOW.as_secs_f64() * BURST_SPAN.as_secs_f64();
                        let fan_out = burst >= 2
                            && in_window * poisson_tail(in_span, burst - 1) < BURST_CHANCE;
                        (steady, if fan_out { burst } else { 0 })
                    }
                    None => (0, 0),
                };
                let held = self.capacity.held.entry(key).or_default();
                held.push_back((now, steady, burst));
                while held
                    .front()
                    .is_some_and(|(t, _, _)| now.saturating_duration_since(*t) >= HOLD)
                {
                    held.pop_front();
                }
                let steady = held
                    .iter()
                    .filter(|(t, _, _)| now.saturating_duration_since(*t) < STEADY_HOLD)
                    .map(|(_, v, _)| *v)
                    .max()
                    .unwrap_or(0);
                let burst = held.iter().map(|(_, _, v)| *v).max().unwrap_or(0);
                let target = steady.max(burst);
                target
                    .clamp(forecast.min_size, forecast.max_size.max(forecast.min_size))
                    .min(cap)
            })
            .collect();
        Planned {
            source: WarmSource::Forecast,
            sizes,
        }
    }
}
