//! Label interning: every label the configuration mentions gets a small
//! integer id, so the router compares bitsets instead of strings.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Dense ids `0..len()` for the labels of one configuration snapshot.
#[derive(Debug, Clone, Default)]
pub(crate) struct Vocabulary {
    ids: HashMap<Box<str>, u32, BuildHasherDefault<LabelHasher>>,
}

impl Vocabulary {
    /// The id of `label`, assigning the next one on first sight.
    pub(crate) fn intern(&mut self, label: &str) -> u32 {
        let next = self.len_u32();
        *self.ids.entry(label.into()).or_insert(next)
    }

    #[inline]
    pub(crate) fn get(&self, label: &str) -> Option<u32> {
        self.ids.get(label).copied()
    }

    fn len_u32(&self) -> u32 {
        // A vocabulary comes from one config file set; four billion distinct
        // labels cannot be loaded into memory, let alone configured.
        u32::try_from(self.ids.len()).unwrap_or(u32::MAX)
    }
}

/// An Fx-style multiply-rotate hash. Job labels are hashed on every routing
/// call and SipHash costs more than the rest of the lookup; hash flooding is
/// not a concern because the table only ever holds configuration labels —
/// request labels are looked up, never inserted.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct LabelHasher {
    hash: u64,
}

const SEED: u64 = 0xf135_7aea_2e62_a9c5;

impl LabelHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for LabelHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // The table indexes with the low bits and tags with the high ones;
        // the product's best-mixed bits are the high ones, so spread them.
        self.hash.rotate_left(26)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interns_densely_and_idempotently() {
        let mut v = Vocabulary::default();
        assert_eq!(v.intern("linux"), 0);
        assert_eq!(v.intern("docker"), 1);
        assert_eq!(v.intern("linux"), 0);
        assert_eq!(v.ids.len(), 2);
        assert_eq!(v.get("docker"), Some(1));
        assert_eq!(v.get("gpu"), None);
        // Same prefix, different tails (remainder handling).
        assert_eq!(v.intern("kici:scaler:abcdefgh1"), 2);
        assert_eq!(v.intern("kici:scaler:abcdefgh2"), 3);
    }
}
