//! The routing table of one configuration snapshot.
//!
//! Every (scaler, label set) pair is a *slot*, numbered in config order.
//! Each label of the vocabulary has a *posting*: the bitset of slots whose
//! enriched set carries it, stored only over the words between its first and
//! last slot (a `kici:scaler:*` label spans one or two words, a common label
//! all of them). Routing a job is then, per 64 slots, an AND of the job's
//! postings minus the excluded labels' postings; only the surviving slots —
//! usually a handful — are checked for cordon and gate and ranked.

use crate::cordon::CordonSet;
use crate::explain::{Candidate, Explanation, Reason};
use crate::platform::{self, HostPlatform, TaintSource};
use crate::vocabulary::Vocabulary;
use kici_model::{Config, Label, LabelSet, ScalerEntry, ScalerName};
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// Where a job goes: indices into `Config::scalers` and that scaler's
/// `label_sets`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Route {
    pub scaler: usize,
    pub label_set: usize,
}

/// The immutable routing table built from one [`Config`] snapshot.
#[derive(Debug, Clone)]
pub struct Router {
    scalers: Vec<ScalerRow>,
    /// Hot data per slot, kept apart from the cold data for cache density.
    slot_keys: Vec<SlotKey>,
    slot_details: Vec<SlotDetail>,
    vocabulary: Vocabulary,
    /// Indexed by label id.
    postings: Vec<Posting>,
    posting_words: Vec<u64>,
    /// The gate of every slot, label ids, back to back (see `SlotKey::gate`).
    gate_ids: Vec<u32>,
    /// `ceil(slots / 64)`.
    slot_words: usize,
    by_name: HashMap<ScalerName, usize>,
}

#[derive(Debug, Clone)]
struct ScalerRow {
    name: ScalerName,
    first_slot: usize,
    label_sets: usize,
    /// `mandatoryLabels`.
    mandatory: LabelSet,
}

#[derive(Debug, Clone, Copy)]
struct SlotKey {
    scaler: u32,
    label_set: u32,
    /// The tie-break measure: distinct configured labels plus role labels.
    rank: u32,
    /// `gate_ids[gate.0 .. gate.0 + gate.1]`: the ids of every label a job
    /// must carry to land here.
    gate: (u32, u32),
}

#[derive(Debug, Clone)]
struct SlotDetail {
    enriched: LabelSet,
    agent_labels: Vec<String>,
    /// `mandatoryLabels` plus the platform taints of this label set.
    gate: LabelSet,
    /// The platform taints, sorted by label, each with its source.
    taints: Vec<(Label, TaintSource)>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Posting {
    first_word: usize,
    len: usize,
    offset: usize,
}

impl Router {
    pub fn new(config: &Config, host: &HostPlatform) -> Router {
        let mut scalers = Vec::with_capacity(config.scalers.len());
        let mut slot_keys = Vec::new();
        let mut slot_details = Vec::new();
        let mut gate_ids = Vec::new();
        let mut vocabulary = Vocabulary::default();
        // Label id → slots carrying it, ascending.
        let mut slots_of: Vec<Vec<usize>> = Vec::new();
        let mut by_name = HashMap::with_capacity(config.scalers.len());

        for (scaler_index, scaler) in config.scalers.iter().enumerate() {
            by_name.entry(scaler.name.clone()).or_insert(scaler_index);
            let platform_taints: Vec<(Label, TaintSource)> = platform::resolve(scaler, host)
                .map(|(p, source)| p.taints().into_iter().map(|t| (t, source)).collect())
                .unwrap_or_default();
            let mut auto = auto_labels(scaler, host);
            auto.extend(platform_taints.iter().map(|(t, _)| t.clone()));
            // Role labels count in the tie-break (so a plain job lands on the
            // least-privileged pool, as upstream); os/arch labels never do:
            // they differ between host platforms and would skew the choice.
            let roles = to_u32(scaler.roles.labels().len());
            scalers.push(ScalerRow {
                name: scaler.name.clone(),
                first_slot: slot_keys.len(),
                label_sets: scaler.label_sets.len(),
                mandatory: scaler.mandatory_labels.clone(),
            });
            for (set_index, set) in scaler.label_sets.iter().enumerate() {
                let slot = slot_keys.len();
                let enriched = LabelSet::from_labels(set.labels.iter().chain(&auto).cloned());
                for label in &enriched {
                    let id = intern(&mut vocabulary, &mut slots_of, label);
                    slots_of[id as usize].push(slot);
                }
                let mut taints = platform_taints.clone();
                for legacy in platform::legacy_taints(&set.labels) {
                    if !taints.iter().any(|(t, _)| t == legacy) {
                        taints.push((legacy.clone(), TaintSource::Label));
                    }
                }
                taints.sort();
                let gate = scaler.mandatory_labels.union(&LabelSet::from_labels(
                    taints.iter().map(|(t, _)| t.clone()),
                ));
                let gate_start = to_u32(gate_ids.len());
                gate_ids.extend(
                    gate.iter()
                        .map(|l| intern(&mut vocabulary, &mut slots_of, l)),
                );
                slot_keys.push(SlotKey {
                    scaler: to_u32(scaler_index),
                    label_set: to_u32(set_index),
                    rank: to_u32(set.labels.len()).saturating_add(roles),
                    gate: (gate_start, to_u32(gate.len())),
                });
                slot_details.push(SlotDetail {
                    enriched,
                    agent_labels: agent_labels(scaler, set, &platform_taints),
                    gate,
                    taints,
                });
            }
        }

        let mut postings = Vec::with_capacity(slots_of.len());
        let mut posting_words = Vec::new();
        for slots in &slots_of {
            let (Some(&first), Some(&last)) = (slots.first(), slots.last()) else {
                postings.push(Posting::default());
                continue;
            };
            let posting = Posting {
                first_word: first / 64,
                len: last / 64 - first / 64 + 1,
                offset: posting_words.len(),
            };
            posting_words.resize(posting.offset + posting.len, 0);
            for &slot in slots {
                posting_words[posting.offset + slot / 64 - posting.first_word] |=
                    1u64 << (slot % 64);
            }
            postings.push(posting);
        }

        Router {
            scalers,
            slot_words: slot_keys.len().div_ceil(64),
            slot_keys,
            slot_details,
            vocabulary,
            postings,
            posting_words,
            gate_ids,
            by_name,
        }
    }

    /// The label set `job` lands on, or `None`. Allocation-free unless the
    /// job or its exclusions name more than eight labels each.
    ///
    /// A job with no labels lands, as upstream routes it, on the first label
    /// set (in config order) without a gate, that is, with no mandatory
    /// labels and no platform taint; unlike upstream, its excluded labels
    /// and cordons still apply.
    pub fn route(&self, job: &LabelSet, exclude: &LabelSet, cordoned: &CordonSet) -> Option<Route> {
        let mut job_ids = SmallBuf::<u32>::new();
        // Per job label, `word + base` indexes its posting word: inside the
        // window every job posting is present, so no range check is needed.
        let mut job_bases = SmallBuf::<usize>::new();
        let (mut lo, mut hi) = (0, self.slot_words);
        for label in job {
            // A label no configured set carries matches nothing.
            let id = self.vocabulary.get(label.as_str())?;
            let posting = self.postings[id as usize];
            lo = lo.max(posting.first_word);
            hi = hi.min(posting.first_word + posting.len);
            job_ids.push(id);
            job_bases.push(posting.offset.wrapping_sub(posting.first_word));
        }
        if lo >= hi {
            return None;
        }
        let mut excluded = SmallBuf::<u32>::new();
        for label in exclude {
            if let Some(id) = self.vocabulary.get(label.as_str()) {
                excluded.push(id);
            }
        }
        let (job_ids, job_bases, excluded) = (
            job_ids.as_slice(),
            job_bases.as_slice(),
            excluded.as_slice(),
        );

        // An empty job takes the first match: every rank is the same.
        let ranked = !job.is_empty();
        // (rank, slot) of the best match so far.
        let mut best: Option<(u32, usize)> = None;
        for word in lo..hi {
            let mut bits = self.live_bits(word);
            for &base in job_bases {
                bits &= self.posting_words[base.wrapping_add(word)];
            }
            for &id in excluded {
                bits &= !self.posting_word(id, word);
            }
            while bits != 0 {
                let slot = word * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let key = self.slot_keys[slot];
                let rank = if ranked { key.rank } else { 0 };
                // Slots come in config order, so only a strictly lower rank
                // can displace the current best.
                if best.is_some_and(|(fewest, _)| fewest <= rank) {
                    continue;
                }
                if cordoned.contains(key.scaler as usize) || !self.gate_open(key, job_ids) {
                    continue;
                }
                best = Some((rank, slot));
            }
        }
        best.map(|(_, slot)| self.route_of(slot))
    }

    /// The decision [`Router::route`] makes, with a [`Reason`] for every
    /// scaler × label set. Slow path (allocates, compares strings): for
    /// `no-backend` answers and operators.
    pub fn explain(&self, job: &LabelSet, exclude: &LabelSet, cordoned: &CordonSet) -> Explanation {
        let mut candidates = Vec::with_capacity(self.slot_keys.len());
        let ranked = !job.is_empty();
        let mut best: Option<(u32, usize)> = None;
        for (slot, (key, detail)) in self.slot_keys.iter().zip(&self.slot_details).enumerate() {
            let scaler = &self.scalers[key.scaler as usize];
            let rank = if ranked { key.rank } else { 0 };
            let reason = if cordoned.contains(key.scaler as usize) {
                Reason::Cordoned
            } else if let Some(missing) = scaler.mandatory.missing_from(job).next() {
                Reason::GatedMissing(missing.clone())
            } else {
                let missing: Vec<Label> = job.missing_from(&detail.enriched).cloned().collect();
                // A taint is reported last: it is the one thing left between
                // the job and a label set that otherwise takes it, so naming
                // it tells the operator exactly which label to add.
                let taint = detail.taints.iter().find(|(t, _)| !job.contains(t));
                if !missing.is_empty() {
                    Reason::NotSuperset(missing)
                } else if let Some(veto) = exclude.iter().find(|l| detail.enriched.contains(l)) {
                    Reason::Excluded(veto.clone())
                } else if let Some((label, source)) = taint {
                    Reason::Tainted {
                        label: label.clone(),
                        source: *source,
                    }
                } else {
                    if best.is_none_or(|(fewest, _)| rank < fewest) {
                        best = Some((rank, slot));
                    }
                    Reason::LargerThanWinner
                }
            };
            candidates.push(Candidate {
                scaler: key.scaler as usize,
                scaler_name: scaler.name.clone(),
                label_set: key.label_set as usize,
                reason,
            });
        }
        if let Some((_, slot)) = best {
            candidates[slot].reason = Reason::Selected;
        }
        Explanation {
            chosen: best.map(|(_, slot)| self.route_of(slot)),
            candidates,
        }
    }

    /// The enriched (matched-against) labels of one label set.
    ///
    /// # Panics
    /// When the indices do not name a label set of the configuration.
    pub fn enriched(&self, scaler: usize, label_set: usize) -> &LabelSet {
        &self.slot_details[self.slot_of(scaler, label_set)].enriched
    }

    /// Every label a job must carry to land on one label set: the scaler's
    /// `mandatoryLabels` plus the label set's platform taints. This is the
    /// gate an agent of that label set is registered under (`mandatoryLabels`
    /// in the registration answer), so that later jobs are held to it too.
    ///
    /// # Panics
    /// When the indices do not name a label set of the configuration.
    pub fn gate(&self, scaler: usize, label_set: usize) -> &LabelSet {
        &self.slot_details[self.slot_of(scaler, label_set)].gate
    }

    /// The platform taints of one label set, sorted by label, with where
    /// each comes from.
    ///
    /// # Panics
    /// When the indices do not name a label set of the configuration.
    pub fn taints(&self, scaler: usize, label_set: usize) -> &[(Label, TaintSource)] {
        &self.slot_details[self.slot_of(scaler, label_set)].taints
    }

    /// The agent's `KICI_LABELS`: the configured labels as written, then
    /// `kici:agent:<type>`, `kici:scaler:<name>`, the role labels and the
    /// scaler's platform taint tokens (so that the agent carries every label
    /// its gate demands), without duplicates (compared case-insensitively,
    /// first spelling kept). No os/arch labels: the agent adds those from its
    /// own host.
    ///
    /// # Panics
    /// When the indices do not name a label set of the configuration.
    pub fn agent_labels(&self, scaler: usize, label_set: usize) -> Vec<String> {
        self.slot_details[self.slot_of(scaler, label_set)]
            .agent_labels
            .clone()
    }

    /// The index of the scaler named exactly `name`.
    pub fn scaler_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    pub fn scaler_count(&self) -> usize {
        self.scalers.len()
    }

    /// The number of label sets of scaler `scaler` (0 for an unknown index).
    pub fn label_set_count(&self, scaler: usize) -> usize {
        self.scalers.get(scaler).map_or(0, |s| s.label_sets)
    }

    fn slot_of(&self, scaler: usize, label_set: usize) -> usize {
        let row = &self.scalers[scaler];
        assert!(
            label_set < row.label_sets,
            "scaler {scaler} ({}) has {} label sets, asked for #{label_set}",
            row.name,
            row.label_sets
        );
        row.first_slot + label_set
    }

    fn route_of(&self, slot: usize) -> Route {
        let key = self.slot_keys[slot];
        Route {
            scaler: key.scaler as usize,
            label_set: key.label_set as usize,
        }
    }

    /// Bits of the slots that exist in `word` (the last word is partial).
    #[inline]
    fn live_bits(&self, word: usize) -> u64 {
        let used = self.slot_keys.len() - word * 64;
        if used >= 64 {
            u64::MAX
        } else {
            (1u64 << used) - 1
        }
    }

    #[inline]
    fn posting_word(&self, id: u32, word: usize) -> u64 {
        let posting = self.postings[id as usize];
        let rel = word.wrapping_sub(posting.first_word);
        if rel < posting.len {
            self.posting_words[posting.offset + rel]
        } else {
            0
        }
    }

    #[inline]
    fn gate_open(&self, key: SlotKey, job_ids: &[u32]) -> bool {
        let (start, len) = (key.gate.0 as usize, key.gate.1 as usize);
        self.gate_ids[start..start + len]
            .iter()
            .all(|id| job_ids.contains(id))
    }
}

fn intern(vocabulary: &mut Vocabulary, slots_of: &mut Vec<Vec<usize>>, label: &Label) -> u32 {
    let id = vocabulary.intern(label.as_str());
    if slots_of.len() <= id as usize {
        slots_of.resize_with(id as usize + 1, Vec::new);
    }
    id
}

/// The auto labels every label set of `scaler` is enriched with (its
/// platform taint tokens are added by the caller).
fn auto_labels(scaler: &ScalerEntry, host: &HostPlatform) -> Vec<Label> {
    let mut labels = platform::os_arch_labels(scaler, host);
    labels.push(Label::auto("agent", scaler.kind.as_str()));
    labels.push(Label::auto("scaler", scaler.name.as_str()));
    labels.extend(scaler.roles.labels());
    labels
}

fn agent_labels(
    scaler: &ScalerEntry,
    set: &kici_model::LabelSetConfig,
    platform_taints: &[(Label, TaintSource)],
) -> Vec<String> {
    // Configs built in code may leave `raw_labels` empty; the normalised
    // labels are then the best spelling there is.
    let configured: Vec<String> = if set.raw_labels.is_empty() {
        set.labels.iter().map(|l| l.to_string()).collect()
    } else {
        set.raw_labels.clone()
    };
    let injected = [
        format!("kici:agent:{}", scaler.kind),
        format!("kici:scaler:{}", scaler.name),
    ]
    .into_iter()
    .chain(scaler.roles.labels().into_iter().map(|l| l.to_string()))
    .chain(platform_taints.iter().map(|(t, _)| t.to_string()));
    let mut seen = HashSet::new();
    configured
        .into_iter()
        .chain(injected)
        .filter(|l| seen.insert(l.to_lowercase()))
        .collect()
}

/// Configurations are bounded far below `u32::MAX` scalers, label sets and
/// labels (each is a YAML node); saturate rather than panic regardless.
fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Label ids kept on the stack by [`Router::route`] before spilling to the
/// heap; runsOn lists are a few labels long.
const INLINE_IDS: usize = 8;

/// A small vector that only allocates past [`INLINE_IDS`] elements.
enum SmallBuf<T: Copy + Default> {
    Inline { items: [T; INLINE_IDS], len: usize },
    Heap(Vec<T>),
}

impl<T: Copy + Default> SmallBuf<T> {
    #[inline]
    fn new() -> Self {
        SmallBuf::Inline {
            items: [T::default(); INLINE_IDS],
            len: 0,
        }
    }

    #[inline]
    fn push(&mut self, item: T) {
        match self {
            SmallBuf::Inline { items, len } if *len < INLINE_IDS => {
                items[*len] = item;
                *len += 1;
            }
            SmallBuf::Inline { items, .. } => {
                let mut spilled = items.to_vec();
                spilled.push(item);
                *self = SmallBuf::Heap(spilled);
            }
            SmallBuf::Heap(items) => items.push(item),
        }
    }

    #[inline]
    fn as_slice(&self) -> &[T] {
        match self {
            SmallBuf::Inline { items, len } => &items[..*len],
            SmallBuf::Heap(items) => items,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_buf_spills_to_heap() {
        let mut buf = SmallBuf::<u32>::new();
        for i in 0..20 {
            buf.push(i);
        }
        assert_eq!(buf.as_slice(), (0..20).collect::<Vec<_>>());
    }

    #[test]
    fn router_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Router>();
        assert_send_sync::<Explanation>();
    }
}
