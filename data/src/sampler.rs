//! Seeded, resumable batching over a dataset of `len` rows.
//!
//! Each epoch visits every row once, in the order of a permutation drawn from `(seed, epoch)`
//! (or in file order without shuffling). Batches are consecutive slices of that order. The
//! sampler's whole state is a [`SamplerState`] (epoch, offset into the epoch's order, and what
//! the order depends on): saved in a checkpoint and restored, the next batch is exactly the one
//! that would have come next, never repeating or skipping a row, across epoch boundaries too.
//!
//! The last incomplete batch of an epoch: with `drop_last` (VeRL's training loader) its rows are
//! skipped for that epoch and the next batch starts the next epoch; without it the short batch is
//! returned.

use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};
use crate::rng::SplitMix64;

/// Where a sampler stands, plus what its order depends on (to refuse a mismatched restore).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// The current epoch (0-based).
    pub epoch: u64,
    /// How many rows of this epoch's order have been handed out.
    pub offset: u64,
    /// Number of rows the order covers.
    pub dataset_len: u64,
    /// Shuffle seed.
    pub seed: u64,
    /// Whether epochs are shuffled.
    pub shuffle: bool,
}

/// One batch of dataset positions and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The epoch the batch belongs to.
    pub epoch: u64,
    /// Offset of the batch's first row within the epoch's order.
    pub offset: u64,
    /// Dataset positions (`0..dataset_len`), in batch order.
    pub positions: Vec<u64>,
}

/// Seeded, resumable batch sampler (see the module documentation).
#[derive(Debug, Clone)]
pub struct Sampler {
    state: SamplerState,
    batch_size: u64,
    drop_last: bool,
    /// The current epoch's order (`None` without shuffling or before first use).
    order: Option<(u64, Vec<u64>)>,
}

impl Sampler {
    /// A sampler at the start of epoch 0.
    pub fn new(
        dataset_len: u64,
        batch_size: usize,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self> {
        if dataset_len == 0 {
            return Err(DataError::InvalidOption {
                option: "sampler".into(),
                problem: "the dataset has no rows to sample".into(),
            });
        }
        if batch_size == 0 {
            return Err(DataError::InvalidOption {
                option: "batch_size".into(),
                problem: "must be at least 1".into(),
            });
        }
        if drop_last && batch_size as u64 > dataset_len {
            return Err(DataError::InvalidOption {
                option: "data.train_batch_size".into(),
                problem: format!(
                    "{batch_size} is larger than the dataset ({dataset_len} rows), so dropping \
                     the incomplete last batch leaves no batch at all; lower it"
                ),
            });
        }
        Ok(Self {
            state: SamplerState {
                epoch: 0,
                offset: 0,
                dataset_len,
                seed,
                shuffle,
            },
            batch_size: batch_size as u64,
            drop_last,
            order: None,
        })
    }

    /// The state to save in a checkpoint.
    pub fn state(&self) -> SamplerState {
        self.state
    }

    /// Moves to a saved position. The saved dataset length, seed and shuffle flag must equal
    /// this sampler's (otherwise the order would differ and rows would repeat or be skipped).
    /// The batch size may differ: the position counts rows, not batches.
    pub fn restore(&mut self, saved: SamplerState) -> Result<()> {
        let current = self.state;
        if saved.dataset_len != current.dataset_len {
            return Err(DataError::SamplerState(format!(
                "it was saved for a dataset of {} rows but this one has {}; the data files or \
                 the filtering options changed since the checkpoint",
                saved.dataset_len, current.dataset_len
            )));
        }
        if saved.seed != current.seed || saved.shuffle != current.shuffle {
            return Err(DataError::SamplerState(format!(
                "it was saved with data.seed = {}, data.shuffle = {} but the recipe now has \
                 data.seed = {}, data.shuffle = {}; restore the original values",
                saved.seed, saved.shuffle, current.seed, current.shuffle
            )));
        }
        if saved.offset > saved.dataset_len {
            return Err(DataError::SamplerState(format!(
                "offset {} is past the end of the epoch ({} rows)",
                saved.offset, saved.dataset_len
            )));
        }
        self.state = saved;
        self.normalize();
        Ok(())
    }

    /// Full batches per epoch (plus one short batch without `drop_last` when the size does not
    /// divide the dataset).
    pub fn batches_per_epoch(&self) -> u64 {
        let len = self.state.dataset_len;
        if self.drop_last {
            len / self.batch_size
        } else {
            len.div_ceil(self.batch_size)
        }
    }

    /// The next batch, moving on to the next epoch when this one is exhausted.
    pub fn next_batch(&mut self) -> Batch {
        self.normalize();
        let SamplerState {
            epoch,
            offset,
            dataset_len,
            ..
        } = self.state;
        let end = (offset + self.batch_size).min(dataset_len);
        let positions = match &self.order {
            Some((_, order)) if self.state.shuffle => order[offset as usize..end as usize].to_vec(),
            _ => (offset..end).collect(),
        };
        self.state.offset = end;
        self.normalize();
        Batch {
            epoch,
            offset,
            positions,
        }
    }

    /// Moves to the next epoch when the current one has no further batch, and makes sure the
    /// current epoch's order is built.
    fn normalize(&mut self) {
        let remaining = self.state.dataset_len - self.state.offset;
        let exhausted = remaining == 0 || (self.drop_last && remaining < self.batch_size);
        if exhausted {
            self.state.epoch += 1;
            self.state.offset = 0;
        }
        if self.state.shuffle && self.order.as_ref().map(|(epoch, _)| *epoch) != Some(self.state.epoch) {
            self.order = Some((
                self.state.epoch,
                epoch_order(self.state.dataset_len, self.state.seed, self.state.epoch),
            ));
        }
    }
}

/// The shuffled order of `len` rows in `epoch` for `seed`.
pub fn epoch_order(len: u64, seed: u64, epoch: u64) -> Vec<u64> {
    let mut order: Vec<u64> = (0..len).collect();
    SplitMix64::for_stream(seed, epoch).shuffle(&mut order);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(sampler: &mut Sampler, batches: usize) -> Vec<Batch> {
        (0..batches).map(|_| sampler.next_batch()).collect()
    }

    #[test]
    fn each_epoch_is_a_permutation_and_epochs_differ() {
        let mut sampler = Sampler::new(10, 3, true, 1, true).unwrap();
        assert_eq!(sampler.batches_per_epoch(), 3);
        let batches = drain(&mut sampler, 6);
        for epoch in 0..2u64 {
            let rows: Vec<u64> = batches
                .iter()
                .filter(|b| b.epoch == epoch)
                .flat_map(|b| b.positions.clone())
                .collect();
            assert_eq!(rows.len(), 9, "drop_last drops 1 of 10 rows per epoch");
            let mut sorted = rows.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), 9, "no row twice in one epoch");
            assert_eq!(rows, epoch_order(10, 1, epoch)[..9].to_vec());
        }
        assert_ne!(epoch_order(10, 1, 0), epoch_order(10, 1, 1));
        assert_ne!(epoch_order(10, 1, 0), epoch_order(10, 2, 0));
        assert_eq!(batches[3].epoch, 1);
        assert_eq!(batches[3].offset, 0);
    }

    #[test]
    fn without_drop_last_the_short_batch_is_returned() {
        let mut sampler = Sampler::new(5, 2, false, 0, false).unwrap();
        assert_eq!(sampler.batches_per_epoch(), 3);
        let batches = drain(&mut sampler, 4);
        assert_eq!(batches[0].positions, vec![0, 1]);
        assert_eq!(batches[1].positions, vec![2, 3]);
        assert_eq!(batches[2].positions, vec![4]);
        assert_eq!((batches[3].epoch, batches[3].positions.clone()), (1, vec![0, 1]));
    }

    #[test]
    fn restores_exactly_at_random_positions_and_epoch_boundaries() {
        // A seeded search over save points, sizes and drop_last, comparing a restored sampler
        // against one that never stopped.
        let mut picks = SplitMix64::new(42);
        for trial in 0..200 {
            let len = 1 + picks.below(40);
            let batch = 1 + picks.below(len) as usize;
            let drop_last = trial % 2 == 0;
            let shuffle = trial % 3 != 0;
            let mut reference = Sampler::new(len, batch, shuffle, 9, drop_last).unwrap();
            let save_after = picks.below(3 * len / batch as u64 + 2) as usize;
            drain(&mut reference, save_after);
            let saved: SamplerState =
                serde_json::from_str(&serde_json::to_string(&reference.state()).unwrap()).unwrap();
            let mut resumed = Sampler::new(len, batch, shuffle, 9, drop_last).unwrap();
            resumed.restore(saved).unwrap();
            assert_eq!(
                drain(&mut reference, 7),
                drain(&mut resumed, 7),
                "len {len} batch {batch} drop_last {drop_last} saved after {save_after}"
            );
        }
    }

    #[test]
    fn saving_at_an_epoch_boundary_continues_with_the_next_epoch() {
        let mut sampler = Sampler::new(6, 3, true, 5, true).unwrap();
        drain(&mut sampler, 2);
        let saved = sampler.state();
        assert_eq!((saved.epoch, saved.offset), (1, 0));
        let mut resumed = Sampler::new(6, 3, true, 5, true).unwrap();
        resumed.restore(saved).unwrap();
        let next = resumed.next_batch();
        assert_eq!(next.epoch, 1);
        assert_eq!(next.positions, epoch_order(6, 5, 1)[..3].to_vec());
        // A state saved before normalisation (offset at the end of the epoch) resumes the same.
        let mut resumed = Sampler::new(6, 3, true, 5, true).unwrap();
        resumed
            .restore(SamplerState {
                epoch: 0,
                offset: 6,
                ..saved
            })
            .unwrap();
        assert_eq!(resumed.next_batch(), next);
    }

    #[test]
    fn refuses_mismatched_states() {
        let mut sampler = Sampler::new(10, 2, true, 1, true).unwrap();
        let state = sampler.state();
        let error = sampler
            .restore(SamplerState {
                dataset_len: 11,
                ..state
            })
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "cannot restore the data sampler: it was saved for a dataset of 11 rows but this one \
             has 10; the data files or the filtering options changed since the checkpoint"
        );
        let error = sampler.restore(SamplerState { seed: 2, ..state }).unwrap_err();
        assert!(error.to_string().contains("data.seed = 2"));
        let error = Sampler::new(3, 4, true, 1, true).unwrap_err();
        assert!(error
            .to_string()
            .contains("4 is larger than the dataset (3 rows)"));
    }
}
