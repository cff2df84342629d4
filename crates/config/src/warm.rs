//! `x-kici-scaler.warmPool`: the warm pool schedule and forecast of one
//! scaler (upstream's own `warmPool` is read in `scaler`).

use crate::cx::{Cx, Keys, Val};
use crate::yaml::quote;
use kici_model::{TimeOfDay, Timezone, WarmForecast, WarmPeriod, WarmPolicy, Weekday};

const KEYS: [&str; 2] = ["schedule", "forecast"];
const PERIOD_KEYS: [&str; 5] = ["days", "from", "to", "timezone", "size"];
const FORECAST_KEYS: [&str; 2] = ["minSize", "maxSize"];

/// `x-kici-scaler.warmPool`; every size is checked against `maxAgents`
/// when that is valid.
pub(crate) fn policy(cx: &mut Cx, v: &Val<'_>, max_agents: Option<u32>) -> Option<WarmPolicy> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(&obj, &KEYS, Keys::Strict, |_| None);
    let schedule = cx
        .opt(&obj, "schedule", |cx, v| {
            let items = cx.list(v)?;
            let before = cx.error_count();
            let out: Vec<WarmPeriod> = items
                .iter()
                .filter_map(|i| period(cx, i, max_agents))
                .collect();
            (cx.error_count() == before).then_some(out)
        })
        .value()
        .unwrap_or_default();
    let forecast = cx
        .opt(&obj, "forecast", |cx, v| forecast(cx, v, max_agents))
        .value();
    (cx.error_count() == before).then_some(WarmPolicy { schedule, forecast })
}

fn period(cx: &mut Cx, v: &Val<'_>, max_agents: Option<u32>) -> Option<WarmPeriod> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(&obj, &PERIOD_KEYS, Keys::Strict, |_| None);
    let days = cx.required(&obj, "days", days);
    let from = cx.required(&obj, "from", time_of_day);
    let to = cx.required(&obj, "to", time_of_day);
    let timezone = cx.required(&obj, "timezone", timezone);
    let size = cx.required(&obj, "size", |cx, v| size(cx, v, max_agents));
    if let (Some(f), Some(t)) = (from, to) {
        if f == t {
            if let Some(tv) = cx.field(&obj, "to") {
                cx.err(
                    &tv,
                    format!("expected a `to` other than `from` ({f}); a whole day is from \"00:00\" to \"24:00\""),
                );
            }
        } else if f == TimeOfDay::END_OF_DAY {
            if let Some(fv) = cx.field(&obj, "from") {
                cx.err(
                    &fv,
                    "expected a start from \"00:00\" to \"23:59\", got \"24:00\"",
                );
            }
        }
    }
    if cx.error_count() != before {
        return None;
    }
    Some(WarmPeriod {
        days: days?,
        from: from?,
        to: to?,
        timezone: timezone?,
        size: size?,
    })
}

fn days(cx: &mut Cx, v: &Val<'_>) -> Option<Vec<Weekday>> {
    let items = cx.list(v)?;
    if items.is_empty() {
        cx.err(v, "expected at least one day, got an empty list");
        return None;
    }
    let choices = Weekday::ALL.map(|d| (d.as_str(), d));
    let before = cx.error_count();
    let mut out = Vec::new();
    for item in &items {
        if let Some(d) = cx.choice(item, &choices) {
            if out.contains(&d) {
                cx.err(item, format!("day {} is listed twice", quote(d.as_str())));
            } else {
                out.push(d);
            }
        }
    }
    (cx.error_count() == before).then_some(out)
}

fn time_of_day(cx: &mut Cx, v: &Val<'_>) -> Option<TimeOfDay> {
    let s = cx.string(v)?;
    match TimeOfDay::parse(&s) {
        Some(t) => Some(t),
        None => {
            cx.err(
                v,
                format!(
                    "expected a time of day \"HH:MM\" from \"00:00\" to \"24:00\", got {}",
                    quote(&s)
                ),
            );
            None
        }
    }
}

fn timezone(cx: &mut Cx, v: &Val<'_>) -> Option<Timezone> {
    let s = cx.string(v)?;
    match Timezone::get(&s) {
        Ok(tz) => Some(tz),
        Err(_) => {
            cx.err(
                v,
                format!(
                    "expected an IANA time zone name such as \"Europe/Paris\" or \"UTC\", got {} (not in this host's time zone database)",
                    quote(&s)
                ),
            );
            None
        }
    }
}

fn size(cx: &mut Cx, v: &Val<'_>, max_agents: Option<u32>) -> Option<u32> {
    let n = cx.non_negative_int(v)?;
    match max_agents {
        Some(max) if n > max => {
            cx.err(
                v,
                format!("expected a size of at most maxAgents ({max}), got {n}"),
            );
            None
        }
        _ => Some(n),
    }
}

fn forecast(cx: &mut Cx, v: &Val<'_>, max_agents: Option<u32>) -> Option<WarmForecast> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(&obj, &FORECAST_KEYS, Keys::Strict, |_| None);
    let min_size = cx
        .opt(&obj, "minSize", |cx, v| size(cx, v, max_agents))
        .value();
    let max_size = cx.required(&obj, "maxSize", |cx, v| size(cx, v, max_agents));
    if cx.error_count() != before {
        return None;
    }
    let (min_size, max_size) = (min_size.unwrap_or(0), max_size?);
    if min_size > max_size {
        cx.err(
            v,
            format!("minSize ({min_size}) must not exceed maxSize ({max_size})"),
        );
        return None;
    }
    Some(WarmForecast { min_size, max_size })
}
