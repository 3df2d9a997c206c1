//! Which compiled programs an engine runs, known once: the KV-cache shape of an engine
//! configuration, the prefill program of each request shape (prompt-length bucket, fan-out
//! width, groups per run), the decode step of each attended cache length and slot bucket
//! (the rows of each slot group it runs on) and the extend program of each bucket of
//! environment tokens (multi-turn). The engine compiles by it ([`crate::Engine::precompile`],
//! and on first use) and `grpo compile` lists a run's programs from it, so both always mean
//! the same programs.

use crate::engine::request::EngineConfig;
use crate::layout::CacheShape;
use model::forward::KvWrite;
use model::ModelConfig;
use xla::runtime::PluginKind;
use xla::DType;

/// A prefill program: prompts padded to `bucket` tokens, each fanned out to `width` KV slots,
/// `batch` prompts per run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrefillKey {
    pub bucket: usize,
    pub width: usize,
    pub batch: usize,
}

/// A decode step: reading the first `chunks` chunks of the cache, with top-k/top-p
/// truncation (`truncate`) or without, for the first `rows` slots of each slot group (a slot
/// bucket, [`ProgramPlan::slot_buckets`]; all of them in the engine's largest step).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DecodeKey {
    pub truncate: bool,
    pub chunks: usize,
    pub rows: usize,
}

/// The fewest rows a slot bucket runs. Operations of few rows may take other kernels whose
/// last bits differ (on the CPU plugin: matrix products below 8 rows for SmolLM2's sizes,
/// below 16 for a 64-wide test model; the attention softmax of a 32-wide model with
/// SmolLM2's vocabulary at 8 rows of 16 on some CPUs); the engine keeps only the buckets
/// whose step gives the bits of the full step ([`crate::Engine::new`] checks each), so that
/// a sample's tokens never depend on how many others are still generating.
pub const MIN_SLOT_BUCKET: usize = 8;

/// The fewest tokens an extend program ([`crate::programs::EnvExtend`]) is compiled for:
/// fewer environment tokens run padded to it, so short tool results share one program.
pub const MIN_EXTEND_BUCKET: usize = 8;

/// The programs of an engine configuration.
#[derive(Clone, Debug)]
pub struct ProgramPlan {
    /// The KV cache: slots, length, chunks, devices and element type.
    pub cache: CacheShape,
    buckets: Vec<usize>,
    prefill_batch: usize,
    slot_buckets: Vec<usize>,
}

impl ProgramPlan {
    /// The plan of an engine with `settings` for a model of `config` over weights of `dtype`
    /// on `devices` devices of a `plugin` (which decides the cache write unless `settings`
    /// do), `settings.tensor_parallel` of them on the tensor-parallel axis.
    pub fn new(
        config: &ModelConfig,
        settings: &EngineConfig,
        devices: usize,
        dtype: DType,
        plugin: PluginKind,
    ) -> ProgramPlan {
        let mut cache = CacheShape::chunked(
            config,
            settings.max_num_seqs,
            settings.max_model_len,
            settings.effective_kv_chunk(),
        )
        .on_devices(devices)
        .with_tensor_parallel(settings.tensor_parallel)
        .for_weights(dtype);
        cache.write = settings.kv_write.unwrap_or(KvWrite::for_plugin(plugin));
        cache.adapters = settings.adapters.clone();
        cache.record_routes = settings.record_routes && config.moe.is_some();
        if config.moe.is_some() {
            cache.moe_lowering = settings.moe_lowering.on(plugin);
        }
        let local = cache.local_slots();
        // A step that slices its rows out of the cache and writes them back (any write but a
        // scatter on one slot group, `programs::decode_sample_program`) pays for that copy:
        // measured on the CPU plugin and by libtpu's cost model, a bucket of half the slots
        // is then slower than the full step, a quarter faster.
        let in_place = cache.write == KvWrite::Scatter && cache.slot_groups() == 1;
        let largest = if in_place { local - 1 } else { local / 4 };
        let mut slot_buckets = Vec::new();
        if settings.compact_slots {
            let mut rows = MIN_SLOT_BUCKET;
            while rows <= largest {
                slot_buckets.push(rows);
                rows *= 2;
            }
        }
        slot_buckets.push(local);
        ProgramPlan {
            cache,
            buckets: settings.buckets(),
            prefill_batch: settings.prefill_batch,
            slot_buckets,
        }
    }

    /// The rows per slot group decode steps are compiled for, ascending: powers of two from
    /// [`MIN_SLOT_BUCKET`] (up to a quarter of a group's slots when the step slices its rows
    /// out of the cache), then every slot of a group (only that without
    /// [`EngineConfig::compact_slots`]).
    pub fn slot_buckets(&self) -> &[usize] {
        &self.slot_buckets
    }

    /// Drops the slot bucket of `rows` rows (never the largest, all of a group's slots).
    pub fn drop_slot_bucket(&mut self, rows: usize) {
        let all = *self.slot_buckets.last().expect("at least one slot bucket");
        self.slot_buckets.retain(|&b| b != rows || b == all);
    }

    /// The smallest slot bucket holding `rows` rows per slot group.
    pub fn slot_bucket(&self, rows: usize) -> usize {
        let all = *self.slot_buckets.last().expect("at least one slot bucket");
        self.slot_buckets
            .iter()
            .copied()
            .find(|&b| b >= rows)
            .unwrap_or(all)
    }

    /// The prompt-length buckets, ascending.
    pub fn buckets(&self) -> &[usize] {
        &self.buckets
    }

    /// The bucket of a prompt of `prompt_len` tokens: a prefill covers the prompt without its
    /// last token (the first decode input).
    pub fn prefill_bucket(&self, prompt_len: usize) -> usize {
        let head = prompt_len.saturating_sub(1).max(1);
        self.buckets
            .iter()
            .copied()
            .find(|&b| b >= head)
            .unwrap_or_else(|| *self.buckets.last().expect("at least one bucket"))
    }

    /// The slots a group of `n` samples is fanned out to (a power of two, at most the slots).
    pub fn fanout_width(&self, n: usize) -> usize {
        let slots = self.cache.slots;
        n.clamp(1, slots).next_power_of_two().min(slots)
    }

    /// Groups of fan-out `width` prefilled in one batched run (1: each alone, the default).
    pub fn prefill_batch(&self, width: usize) -> usize {
        self.prefill_batch.min(self.cache.slots / width.max(1)).max(1)
    }

    /// The prefill of one run for a group of `n` samples of a `prompt_len`-token prompt, `batch`
    /// groups at a time.
    pub fn prefill(&self, prompt_len: usize, n: usize, batch: usize) -> PrefillKey {
        PrefillKey {
            bucket: self.prefill_bucket(prompt_len),
            width: self.fanout_width(n),
            batch,
        }
    }

    /// The chunk count of the decode step when the highest active position is `position`.
    pub fn decode_chunks(&self, position: usize) -> usize {
        self.cache.decode_chunks(position)
    }

    /// Every decode chunk count a sequence passes through from `position` to the end of the
    /// cache (powers of two, then all chunks).
    pub fn decode_chunk_counts(&self, position: usize) -> Vec<usize> {
        let mut counts = vec![self.decode_chunks(position)];
        while let Some(&last) = counts.last().filter(|&&c| c < self.cache.chunks()) {
            counts.push(self.decode_chunks(last * self.cache.chunk));
        }
        counts
    }

    /// The extend program that writes `n` environment tokens into a slot: `n` rounded up to
    /// a power of two, at least [`MIN_EXTEND_BUCKET`].
    pub fn extend_bucket(&self, n: usize) -> usize {
        n.next_power_of_two().max(MIN_EXTEND_BUCKET)
    }

    /// Every extend program a multi-turn sample of up to `response` tokens may run (its
    /// environment tokens between two turns are fewer than its response budget), ascending.
    pub fn extend_buckets(&self, response: usize) -> Vec<usize> {
        let top = self.extend_bucket(response.clamp(1, self.cache.max_len));
        std::iter::successors(Some(MIN_EXTEND_BUCKET), |&b| (b < top).then_some(b * 2)).collect()
    }

    /// What requests with prompts of `prompt_len` tokens in groups of `n` need: their prefill,
    /// alone and batched when batching applies, and the decode steps for every cache length
    /// from the prompt's to the longest and every slot bucket, with the top-k/top-p variants
    /// when `truncating`.
    pub fn request_programs(
        &self,
        prompt_len: usize,
        n: usize,
        truncating: bool,
    ) -> (Vec<PrefillKey>, Vec<DecodeKey>) {
        let single = self.prefill(prompt_len, n, 1);
        let mut prefills = vec![single];
        let batch = self.prefill_batch(single.width);
        if batch > 1 {
            prefills.push(PrefillKey { batch, ..single });
        }
        let mut decodes = Vec::new();
        for chunks in self.decode_chunk_counts(prompt_len.saturating_sub(1)) {
            for &rows in &self.slot_buckets {
                for truncate in [false, true] {
                    if truncating || !truncate {
                        decodes.push(DecodeKey {
                            truncate,
                            chunks,
                            rows,
                        });
                    }
                }
            }
        }
        (prefills, decodes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(slots: usize, len: usize, kv_chunk: usize, prefill_batch: usize) -> ProgramPlan {
        let mut settings = EngineConfig::new(slots, len);
        settings.kv_chunk = kv_chunk;
        settings.prefill_batch = prefill_batch;
        settings.compact_slots = false;
        ProgramPlan::new(
            &ModelConfig::tiny_llama(),
            &settings,
            1,
            DType::F32,
            PluginKind::Cpu,
        )
    }

    #[test]
    fn prefill_keys_pick_the_bucket_of_the_prompt_head_and_a_power_of_two_width() {
        let p = plan(16, 100, 0, 1);
        assert_eq!(p.buckets(), &[16, 32, 64, 100]);
        // The prefill covers 16 of a 17-token prompt: bucket 16; 18 tokens need 32.
        assert_eq!(
            p.prefill(17, 3, 1),
            PrefillKey {
                bucket: 16,
                width: 4,
                batch: 1
            }
        );
        assert_eq!(p.prefill_bucket(18), 32);
        assert_eq!(p.fanout_width(40), 16);
        assert_eq!(p.prefill_batch(4), 1);
        assert_eq!(plan(16, 100, 0, 8).prefill_batch(4), 4);
    }

    #[test]
    fn decode_chunk_counts_double_up_to_every_chunk() {
        // 5 chunks of 20: 1, 2, 4, then all 5.
        let p = plan(4, 100, 20, 1);
        assert_eq!(p.cache.chunks(), 5);
        assert_eq!(p.decode_chunk_counts(0), vec![1, 2, 4, 5]);
        assert_eq!(p.decode_chunk_counts(45), vec![4, 5]);
        assert_eq!(plan(4, 100, 0, 1).decode_chunk_counts(0), vec![1]);
    }

    #[test]
    fn request_programs_add_batched_prefill_and_truncating_decode() {
        let (prefills, decodes) = plan(16, 100, 50, 2).request_programs(10, 4, true);
        assert_eq!(
            prefills,
            vec![
                PrefillKey {
                    bucket: 16,
                    width: 4,
                    batch: 1
                },
                PrefillKey {
                    bucket: 16,
                    width: 4,
                    batch: 2
                }
            ]
        );
        let chunks: Vec<(bool, usize)> = decodes.iter().map(|d| (d.truncate, d.chunks)).collect();
        assert_eq!(chunks, vec![(false, 1), (true, 1), (false, 2), (true, 2)]);
        assert!(decodes.iter().all(|d| d.rows == 16));
    }

    #[test]
    fn extend_buckets_are_powers_of_two_from_eight_up_to_the_response_budget() {
        let p = plan(4, 100, 0, 1);
        assert_eq!([1, 8, 9, 33, 64].map(|n| p.extend_bucket(n)), [8, 8, 16, 64, 64]);
        assert_eq!(p.extend_buckets(40), vec![8, 16, 32, 64]);
        assert_eq!(p.extend_buckets(3), vec![8]);
        // Never past the cache: a budget beyond it is the cache's.
        assert_eq!(p.extend_buckets(1000), vec![8, 16, 32, 64, 128]);
    }

    #[test]
    fn slot_buckets_double_from_eight_rows_to_each_groups_slots() {
        let compacting = |slots: usize, devices: usize| {
            let mut settings = EngineConfig::new(slots, 64);
            settings.compact_slots = true;
            ProgramPlan::new(
                &ModelConfig::tiny_llama(),
                &settings,
                devices,
                DType::F32,
                PluginKind::Cpu,
            )
        };
        let p = compacting(100, 1);
        assert_eq!(p.slot_buckets(), &[8, 16, 32, 64, 100]);
        assert_eq!(
            [1, 8, 9, 64, 65, 100].map(|r| p.slot_bucket(r)),
            [8, 8, 16, 64, 100, 100]
        );
        // Over 4 slot groups each holds 32 slots, and buckets that are sliced out of the
        // cache stop at a quarter of them; a small engine has one bucket.
        assert_eq!(compacting(128, 4).slot_buckets(), &[8, 32]);
        assert_eq!(compacting(512, 4).slot_buckets(), &[8, 16, 32, 128]);
        assert_eq!(compacting(6, 1).slot_buckets(), &[6]);
        assert_eq!(plan(100, 64, 0, 1).slot_buckets(), &[100]);
        let (_, decodes) = compacting(16, 1).request_programs(10, 4, false);
        let rows: Vec<usize> = decodes.iter().map(|d| d.rows).collect();
        assert_eq!(rows, vec![8, 16]);
    }
}
