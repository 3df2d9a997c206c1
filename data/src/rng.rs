//! A small seeded random number generator whose output is fixed forever (SplitMix64, Steele,
//! Lea and Flood 2014), so that shuffles and generated datasets are the same on every platform
//! and every version of this crate, unlike `rand`'s `StdRng`, whose algorithm may change.

/// SplitMix64: 64-bit state, passes BigCrush; plenty for shuffling and task generation.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator for one stream of a seeded process (e.g. epoch 3 of seed 1): the two numbers
    /// are mixed so that neighbouring seeds and streams give unrelated sequences.
    pub fn for_stream(seed: u64, stream: u64) -> Self {
        let mut mixer = SplitMix64::new(seed);
        let first = mixer.next_u64();
        let mut mixer = SplitMix64::new(first ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        Self::new(mixer.next_u64())
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `0..bound` (`bound > 0`), without modulo bias (Lemire 2019).
    pub fn below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0, "below(0) has no values to choose from");
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let product = u128::from(self.next_u64()) * u128::from(bound);
            if (product as u64) >= threshold {
                return (product >> 64) as u64;
            }
        }
    }

    /// A uniform integer in `low..=high`.
    pub fn in_range(&mut self, low: i64, high: i64) -> i64 {
        assert!(low <= high, "empty range {low}..={high}");
        let span = (high as i128 - low as i128 + 1) as u128;
        if span > u128::from(u64::MAX) {
            return self.next_u64() as i64;
        }
        (low as i128 + self.below(span as u64) as i128) as i64
    }

    /// Shuffles `items` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for last in (1..items.len()).rev() {
            let pick = self.below(last as u64 + 1) as usize;
            items.swap(last, pick);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_splitmix64_sequence() {
        // Reference values of SplitMix64 seeded with 0 (as in Vigna's splitmix64.c).
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(rng.next_u64(), 0x06C4_5D18_8009_454F);
    }

    #[test]
    fn below_is_uniform_enough_and_in_range() {
        let mut rng = SplitMix64::new(7);
        let mut counts = [0u32; 6];
        for _ in 0..60_000 {
            counts[rng.below(6) as usize] += 1;
        }
        for count in counts {
            assert!((9_500..10_500).contains(&count), "counts {counts:?}");
        }
        for _ in 0..1000 {
            let value = rng.in_range(-3, 4);
            assert!((-3..=4).contains(&value));
        }
    }

    #[test]
    fn shuffle_is_a_permutation_and_streams_differ() {
        let mut items: Vec<u32> = (0..100).collect();
        SplitMix64::for_stream(1, 0).shuffle(&mut items);
        let mut sorted = items.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(items, sorted);
        let mut other: Vec<u32> = (0..100).collect();
        SplitMix64::for_stream(1, 1).shuffle(&mut other);
        assert_ne!(items, other);
    }
}
