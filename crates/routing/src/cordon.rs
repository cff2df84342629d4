//! The set of cordoned scalers, by index into `Config::scalers`.
//!
//! The engine keeps one and hands it to every routing call, so it is a plain
//! bitset: `contains` is a shift and a mask, and [`CordonSet::none`] does not
//! allocate.

/// Scaler indices that must not receive new agents.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct CordonSet {
    /// Bit `i % 64` of word `i / 64` is scaler `i`. Trailing zero words are
    /// trimmed so that equal sets compare equal.
    words: Vec<u64>,
}

impl CordonSet {
    /// No scaler cordoned.
    pub const fn none() -> Self {
        Self { words: Vec::new() }
    }

    pub fn from_indices(indices: impl IntoIterator<Item = usize>) -> Self {
        let mut set = Self::none();
        for i in indices {
            set.insert(i);
        }
        set
    }

    /// Cordons scaler `index`; true when it was not cordoned before.
    pub fn insert(&mut self, index: usize) -> bool {
        let (word, bit) = (index / 64, 1u64 << (index % 64));
        if self.words.len() <= word {
            self.words.resize(word + 1, 0);
        }
        // `resize` above guarantees the word exists.
        let slot = &mut self.words[word];
        let was_clear = *slot & bit == 0;
        *slot |= bit;
        was_clear
    }

    /// Uncordons scaler `index`; true when it was cordoned.
    pub fn remove(&mut self, index: usize) -> bool {
        let (word, bit) = (index / 64, 1u64 << (index % 64));
        let Some(slot) = self.words.get_mut(word) else {
            return false;
        };
        let was_set = *slot & bit != 0;
        *slot &= !bit;
        while self.words.last() == Some(&0) {
            self.words.pop();
        }
        was_set
    }

    #[inline]
    pub fn contains(&self, index: usize) -> bool {
        self.words
            .get(index / 64)
            .is_some_and(|w| w & (1u64 << (index % 64)) != 0)
    }

    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// The cordoned indices, ascending.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.words.iter().enumerate().flat_map(|(w, &word)| {
            (0..64)
                .filter(move |b| word & (1u64 << b) != 0)
                .map(move |b| w * 64 + b)
        })
    }
}

impl FromIterator<usize> for CordonSet {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Self {
        Self::from_indices(iter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_contains() {
        let mut set = CordonSet::none();
        assert!(set.is_empty());
        assert!(!set.contains(0));
        assert!(set.insert(3));
        assert!(!set.is_empty());
        assert!(!set.insert(3));
        // A clear bit in a used word is not "removed".
        assert!(!set.remove(5));
        assert!(set.contains(3));
        assert!(set.insert(130));
        assert!(set.contains(3) && set.contains(130));
        assert!(!set.contains(4) && !set.contains(129) && !set.contains(10_000));
        assert_eq!(set.iter().collect::<Vec<_>>(), [3, 130]);
        assert!(set.remove(130));
        assert!(!set.remove(130));
        assert!(!set.remove(99_999));
        assert_eq!(set, CordonSet::from_indices([3]));
        assert!(set.remove(3));
        assert_eq!(set, CordonSet::none());
        assert_eq!(
            [1usize, 64, 1]
                .into_iter()
                .collect::<CordonSet>()
                .iter()
                .collect::<Vec<_>>(),
            [1, 64]
        );
    }
}
