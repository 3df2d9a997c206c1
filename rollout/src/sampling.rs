//! Sampling parameters and the on-device sampler fused into the decode program.
//!
//! Randomness is counter-based: the key of one draw is
//! `threefry2x32([seed_lo, seed_hi], [sample_index, token_index])` (computed on the host by
//! [`draw_key`]); the device turns it into one uniform per draw ([`row_uniform`]). A
//! sample's tokens therefore depend only on (seed, sample index, token index, logits), never
//! on what else is in the batch.
//!
//! The sampler ([`SamplerKind::InverseCdf`]) draws by inverse CDF: the first token whose
//! running sum of `exp(logits / T - max)` reaches `u` times the total, an exact draw from
//! `softmax(logits / T)` up to f32 rounding; min-p, top-k and top-p zero the mass outside the
//! kept set first. Temperature 0 is greedy (the first maximum of the logits). The Gumbel-max
//! sampler ([`SamplerKind::GumbelMax`], one uniform per vocabulary entry from
//! `threefry2x32(key, [0, v])`, see [`draw_uniform`]) is kept to compare against.
//!
//! The reported log-probability of a sampled token is taken under the temperature-scaled
//! *full* distribution `log_softmax(logits / T)`, before min-p/top-k/top-p truncation (what VeRL and
//! vLLM report, and what the trainer recomputes with `logprobs` at the same temperature). Under
//! greedy decoding it is `log_softmax(logits)` (temperature 1).

use xla::graph::random::threefry2x32;
use xla::graph::Tensor;
use xla::DType;

/// Logit value given to tokens removed by top-k / top-p (finite, so sums stay finite).
const REMOVED_LOGIT: f64 = -1.0e30;

/// How one request's samples are drawn and when they stop.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 for greedy decoding; otherwise sample from `softmax(logits / temperature)`.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`
    /// (applied after top-k and min-p, on their renormalised distribution); 1.0 = no limit.
    pub top_p: f32,
    /// Keep only tokens whose probability is at least `min_p` times the most likely token's,
    /// under `softmax(logits / temperature)` (vLLM's min-p, applied before top-p); 0 = off.
    pub min_p: f32,
    /// Most tokens to generate per sample.
    pub max_new_tokens: usize,
    /// Token ids that end a sample (kept as the last response token), in addition to the
    /// engine's end-of-sequence ids.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end a sample when they appear in the decoded response text; the text is
    /// cut before the stop string, the response ids keep the token that completed it.
    pub stop_strings: Vec<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            max_new_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            max_new_tokens,
            ..Default::default()
        }
    }

    /// Checks the values; the message names the bad field and the allowed range.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature must be finite and >= 0 (0 = greedy), got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(format!("min_p must be in [0, 1] (0 = off), got {}", self.min_p));
        }
        if self.max_new_tokens == 0 {
            return Err("max_new_tokens must be at least 1".to_string());
        }
        if self.stop_strings.iter().any(|s| s.is_empty()) {
            return Err("stop strings must not be empty".to_string());
        }
        Ok(())
    }

    /// Whether this request needs the sorting (top-k / top-p / min-p) sampler.
    pub fn needs_truncation(&self) -> bool {
        self.temperature > 0.0 && (self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0)
    }
}

/// The Threefry key of draw `token_index` of sample `sample_index` of a request seeded with
/// `seed`.
pub fn draw_key(seed: u64, sample_index: u32, token_index: u32) -> [u32; 2] {
    threefry2x32([seed as u32, (seed >> 32) as u32], [sample_index, token_index])
}

/// The uniform in (0, 1) the sampler uses for vocabulary entry `v` (of `vocab`) under `key`:
/// one Threefry call gives two words, so entry `v < ceil(vocab / 2)` takes word 0 of counter
/// `(0, v)` and the entry `ceil(vocab / 2)` later takes word 1 (the host twin of the device
/// computation, for tests).
pub fn draw_uniform(key: [u32; 2], v: u32, vocab: u32) -> f32 {
    let half = vocab.div_ceil(2);
    let bits = if v < half {
        threefry2x32(key, [0, v])[0]
    } else {
        threefry2x32(key, [0, v - half])[1]
    };
    ((bits >> 9) as f32 + 0.5) * (1.0 / 8_388_608.0)
}

const ROTATIONS: [u32; 8] = [13, 15, 26, 6, 17, 29, 16, 24];
const KEY_PARITY: u32 = 0x1BD1_1BDA;

/// Threefry-2x32 (20 rounds) with a different key per row: `keys [S, 2]` u32, counters
/// `(0, v)` for `v` in `0..ceil(width / 2)`; returns both output words side by side, cut to
/// `[S, width]` u32 (see [`draw_uniform`]).
fn row_keyed_bits(keys: &Tensor, width: i64) -> Tensor {
    let g = keys.graph().clone();
    let s = keys.dims()[0];
    let half = (width + 1) / 2;
    let dims = [s, half];
    let word = |i: i64| keys.slice_axis(1, i, i + 1).broadcast_to(&dims);
    let k0 = word(0);
    let k1 = word(1);
    let k2 = k0.xor(&k1).xor(&g.full(KEY_PARITY as f64, DType::U32, &dims));
    let ks = [k0, k1, k2];
    let rotl = |x: &Tensor, r: u32| -> Tensor {
        let left = x.shift_left(&g.full(r as f64, DType::U32, &dims));
        let right = x.shift_right_logical(&g.full((32 - r) as f64, DType::U32, &dims));
        left.or(&right)
    };
    let mut x0 = ks[0].clone();
    let mut x1 = &g.iota(DType::U32, &dims, 1) + &ks[1];
    for r in 0..20 {
        x0 = &x0 + &x1;
        x1 = rotl(&x1, ROTATIONS[r % 8]).xor(&x0);
        if r % 4 == 3 {
            let j = (r + 1) / 4;
            x0 = &x0 + &ks[j % 3];
            x1 = &(&x1 + &ks[(j + 1) % 3]) + &g.full(j as f64, DType::U32, &dims);
        }
    }
    Tensor::concat(&[&x0, &x1], 1).slice_axis(1, 0, width)
}

/// Uniforms in (0, 1) `[S, width]` from per-row keys (see [`draw_uniform`]).
fn row_keyed_uniform(keys: &Tensor, width: i64) -> Tensor {
    let g = keys.graph().clone();
    let dims = [keys.dims()[0], width];
    let bits = row_keyed_bits(keys, width);
    let mantissa = bits
        .shift_right_logical(&g.full(9.0, DType::U32, &dims))
        .convert(DType::F32);
    &(&mantissa + 0.5) * (1.0 / 8_388_608.0)
}

/// One uniform in (0, 1) per row `[S]` from per-row keys `[S, 2]` (see [`row_uniform`]).
fn row_uniform_graph(keys: &Tensor) -> Tensor {
    let g = keys.graph().clone();
    let s = keys.dims()[0];
    let bits = row_keyed_bits(keys, 1)
        .reshape(&[s])
        .shift_right_logical(&g.full(8.0, DType::U32, &[s]))
        .convert(DType::F32);
    &(&bits + 0.5) * (1.0 / 16_777_216.0)
}

/// Per-row sampling inputs of the fused sampler (all `[S]` except `keys [S, 2]` u32).
pub struct SamplerInputs<'a> {
    /// Temperature per row (f32; <= 0 is greedy).
    pub temperature: &'a Tensor,
    /// Top-k per row (i32; <= 0 = off). Used only when `truncate`.
    pub top_k: &'a Tensor,
    /// Top-p per row (f32; >= 1 = off). Used only when `truncate`.
    pub top_p: &'a Tensor,
    /// Min-p per row (f32; <= 0 = off). Used only when `truncate`.
    pub min_p: &'a Tensor,
    /// Threefry key per row.
    pub keys: &'a Tensor,
}

/// How the fused sampler turns logits and keys into a token.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SamplerKind {
    /// Inverse CDF: one uniform `u` per row (word 0 of `threefry2x32(key, [0, 0])`, 24 bits;
    /// see [`row_uniform`]), and the token is the first whose running sum of
    /// `exp(logits / T - max)` reaches `u` times the total. The running sum is taken in two
    /// levels (blocks of [`CDF_BLOCK`] entries, then within the chosen block), so it costs one
    /// pass of `exp` over the vocabulary, shared with the log-softmax normaliser. The default.
    #[default]
    InverseCdf,
    /// Gumbel-max: `argmax(logits / T + G)` with one Gumbel draw per vocabulary entry (a
    /// Threefry call per two entries and two logarithms per entry; see [`draw_uniform`]).
    /// Kept to compare against; it costs several times more than [`SamplerKind::InverseCdf`].
    GumbelMax,
}

/// Block size of the two-level running sum of [`SamplerKind::InverseCdf`].
pub const CDF_BLOCK: i64 = 256;

/// The uniform in (0, 1) of one inverse-CDF draw under `key`: the top 24 bits of word 0 of
/// `threefry2x32(key, [0, 0])` (the host twin of the device computation, for tests).
pub fn row_uniform(key: [u32; 2]) -> f32 {
    let bits = threefry2x32(key, [0, 0])[0];
    ((bits >> 8) as f32 + 0.5) * (1.0 / 16_777_216.0)
}

/// Samples one token per row of `logits [S, V]` (f32) with the default
/// [`SamplerKind::InverseCdf`]. `truncate` compiles the top-k / top-p / min-p path (a sort
/// over the vocabulary); without it those inputs are ignored. Returns `(tokens [S] i32, logprobs [S]
/// f32)`; see the module comment for what the log-probability is.
pub fn sample_graph(logits: &Tensor, inputs: &SamplerInputs<'_>, truncate: bool) -> (Tensor, Tensor) {
    sample_graph_with(logits, inputs, truncate, SamplerKind::default())
}

/// [`sample_graph`] with a choice of sampler.
pub fn sample_graph_with(
    logits: &Tensor,
    inputs: &SamplerInputs<'_>,
    truncate: bool,
    kind: SamplerKind,
) -> (Tensor, Tensor) {
    let g = logits.graph().clone();
    let (s, v) = (logits.dims()[0], logits.dims()[1]);
    let sv = [s, v];
    let row = |t: &Tensor| t.reshape(&[s, 1]).broadcast_to(&sv);
    let temperature = inputs.temperature.convert_if_needed(DType::F32);
    let greedy = temperature.le(&g.zeros(DType::F32, &[s]));
    let t_eff = greedy.select(&g.ones(DType::F32, &[s]), &temperature);
    let scaled = logits / &row(&t_eff);
    // log_softmax(scaled)[token] = scaled[token] - max - ln(sum(exp(scaled - max))).
    let max = scaled.max_axis(1, false);
    let shifted = &scaled - &row(&max);
    let weights = shifted.exp();
    let log_norm = &max + &weights.reduce_sum(&[1]).log();
    let removed = g.full(REMOVED_LOGIT, DType::F32, &sv);

    let candidates = if truncate {
        let (sorted, _) = scaled.sort(true);
        let rank = g.iota(DType::I32, &sv, 1);
        let top_k = inputs.top_k.convert_if_needed(DType::I32);
        let k_off = top_k
            .le(&g.zeros(DType::I32, &[s]))
            .or(&top_k.gt(&g.full(v as f64, DType::I32, &[s])));
        let k_eff = k_off.select(&g.full(v as f64, DType::I32, &[s]), &top_k);
        // min-p keeps the tokens within ln(min_p) of the best in `scaled`: p >= min_p * p_max.
        let min_p = inputs.min_p.convert_if_needed(DType::F32);
        let floor = min_p
            .gt(&g.zeros(DType::F32, &[s]))
            .select(&(&max + &min_p.log()), &g.full(REMOVED_LOGIT, DType::F32, &[s]));
        let in_k = rank.lt(&row(&k_eff)).and(&sorted.ge(&row(&floor)));
        let probs_k = in_k.select(&sorted, &removed).softmax(-1);
        let before = &probs_k.cumsum(1, false) - &probs_k;
        let top_p = inputs.top_p.convert_if_needed(DType::F32);
        let p_off = top_p.ge(&g.ones(DType::F32, &[s]));
        let p_eff = p_off.select(&g.full(2.0, DType::F32, &[s]), &top_p);
        let keep = in_k.and(&before.lt(&row(&p_eff)));
        let count = keep.convert(DType::I32).reduce_sum(&[1]);
        let last = (&count - &g.ones(DType::I32, &[s])).max(&g.zeros(DType::I32, &[s]));
        let threshold = sorted.take_along_last_axis(&last.reshape(&[s, 1]));
        let allowed = scaled.ge(&threshold.broadcast_to(&sv));
        Some(allowed)
    } else {
        None
    };
    let sampled = match kind {
        SamplerKind::InverseCdf => {
            let mass = match &candidates {
                Some(allowed) => allowed.select(&weights, &weights.zeros_like()),
                None => weights.clone(),
            };
            inverse_cdf(&mass, &row_uniform_graph(inputs.keys))
        }
        SamplerKind::GumbelMax => {
            let candidates = match &candidates {
                Some(allowed) => allowed.select(&scaled, &removed),
                None => scaled.clone(),
            };
            let u = row_keyed_uniform(inputs.keys, v);
            let gumbel = u.log().neg().log().neg();
            (&candidates + &gumbel).argmax(-1)
        }
    };
    let best = logits.argmax(-1);
    let tokens = greedy.select(&best, &sampled);
    let token_lp = &scaled
        .take_along_last_axis(&tokens.reshape(&[s, 1]))
        .reshape(&[s])
        - &log_norm;
    (tokens, token_lp)
}

/// The first index per row of `mass [S, V]` (non-negative, unnormalised) whose running sum
/// reaches `u [S]` (in (0, 1)) times the row total: an exact draw from `mass / total` up to
/// f32 rounding. Two levels: block totals of [`CDF_BLOCK`] entries and their running sum pick
/// the block, then the running sum inside that block picks the entry. Rounding can never pick
/// an entry of zero mass: the pick moves to the nearest earlier (else later) entry with mass.
fn inverse_cdf(mass: &Tensor, u: &Tensor) -> Tensor {
    let g = mass.graph().clone();
    let (s, v) = (mass.dims()[0], mass.dims()[1]);
    let block = CDF_BLOCK.min(v);
    let blocks = (v + block - 1) / block;
    let padded = if blocks * block > v {
        mass.pad(
            &g.scalar(0.0, DType::F32),
            &[0, 0],
            &[0, blocks * block - v],
            &[0, 0],
        )
    } else {
        mass.clone()
    };
    let per_block = padded.reshape(&[s, blocks, block]).reduce_sum(&[2]);
    let running = per_block.cumsum(1, false);
    let total = running.slice_axis(1, blocks - 1, blocks).reshape(&[s]);
    let target = &total * u;
    // The first index whose running sum reaches the target, limited to entries with mass.
    let pick = |running: &Tensor, weights: &Tensor, target: &Tensor, n: i64| -> Tensor {
        let dims = [s, n];
        let below = running.lt(&target.reshape(&[s, 1]).broadcast_to(&dims));
        let first = below.convert(DType::I32).reduce_sum(&[1]);
        let first = first.min(&g.full((n - 1) as f64, DType::I32, &[s]));
        let idx = g.iota(DType::I32, &dims, 1);
        let positive = weights.gt(&weights.zeros_like());
        let first_b = first.reshape(&[s, 1]).broadcast_to(&dims);
        let none = g.full(-1.0, DType::I32, &dims);
        let at_or_before = positive
            .and(&idx.le(&first_b))
            .select(&idx, &none)
            .reduce_max(&[1]);
        let after = positive
            .select(&idx, &g.full(n as f64, DType::I32, &dims))
            .reduce_min(&[1])
            .min(&g.full((n - 1) as f64, DType::I32, &[s]));
        at_or_before
            .ge(&g.zeros(DType::I32, &[s]))
            .select(&at_or_before, &after)
    };
    let b = pick(&running, &per_block, &target, blocks);
    let before_block = &running.take_along_last_axis(&b.reshape(&[s, 1])).reshape(&[s])
        - &per_block.take_along_last_axis(&b.reshape(&[s, 1])).reshape(&[s]);
    let rows = &(&g.iota(DType::I32, &[s], 0) * (blocks as f64)) + &b;
    let inside = padded.reshape(&[s * blocks, block]).take(&rows, 0);
    let inside_running = inside.cumsum(1, false);
    let rest = &target - &before_block;
    let i = pick(&inside_running, &inside, &rest, block);
    &(&b * (block as f64)) + &i
}

/// The distribution the sampler draws from, computed on the host in f64 from one row of
/// logits: `softmax(logits / T)` restricted to top-k and min-p, then top-p (renormalised), or a
/// point mass on the first maximum when `T == 0`. For tests and for checking the device sampler.
pub fn reference_distribution(logits: &[f32], params: &SamplingParams) -> Vec<f64> {
    let v = logits.len();
    let mut out = vec![0.0; v];
    if params.temperature <= 0.0 {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        out[best] = 1.0;
        return out;
    }
    let t = params.temperature as f64;
    let mut order: Vec<usize> = (0..v).collect();
    order.sort_by(|&a, &b| {
        logits[b]
            .partial_cmp(&logits[a])
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let k = if params.top_k == 0 || params.top_k > v {
        v
    } else {
        params.top_k
    };
    let max = logits[order[0]] as f64 / t;
    // min-p: p_i >= min_p * p_max, i.e. logit_i / T >= max + ln(min_p).
    let k = if params.min_p > 0.0 {
        let floor = max + (params.min_p as f64).ln();
        k.min(
            order
                .iter()
                .take_while(|&&i| logits[i] as f64 / t >= floor)
                .count(),
        )
    } else {
        k
    };
    let kept = &order[..k];
    let w: Vec<f64> = kept.iter().map(|&i| (logits[i] as f64 / t - max).exp()).collect();
    let total: f64 = w.iter().sum();
    let mut mass = 0.0;
    let mut chosen = Vec::new();
    for (j, &i) in kept.iter().enumerate() {
        if params.top_p < 1.0 && mass >= params.top_p as f64 {
            break;
        }
        chosen.push((i, w[j]));
        mass += w[j] / total;
    }
    let z: f64 = chosen.iter().map(|c| c.1).sum();
    for (i, wi) in chosen {
        out[i] = wi / z;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_validated_with_the_field_named() {
        let mut p = SamplingParams::default();
        assert!(p.validate().is_ok());
        p.top_p = 0.0;
        assert!(p.validate().unwrap_err().contains("top_p"));
        p = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().contains("temperature"));
        p = SamplingParams {
            max_new_tokens: 0,
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().contains("max_new_tokens"));
        assert!(!SamplingParams::greedy(4).needs_truncation());
        assert!(SamplingParams {
            top_k: 3,
            ..Default::default()
        }
        .needs_truncation());
    }

    #[test]
    fn keys_depend_on_seed_sample_and_position_only() {
        assert_eq!(draw_key(7, 1, 2), draw_key(7, 1, 2));
        assert_ne!(draw_key(7, 1, 2), draw_key(7, 2, 1));
        assert_ne!(draw_key(7, 1, 2), draw_key(8, 1, 2));
        assert_ne!(draw_key(1 << 40, 0, 0), draw_key(0, 0, 0));
        let u = draw_uniform(draw_key(3, 0, 0), 5, 32);
        assert!(u > 0.0 && u < 1.0);
    }

    #[test]
    fn device_uniforms_equal_the_host_threefry_bit_for_bit() {
        let client = xla::runtime::Client::cpu(1).unwrap();
        let g = xla::graph::Graph::new("uniforms");
        let keys = g.parameter("keys", DType::U32, &[3, 2]);
        let u = row_keyed_uniform(&keys, 41);
        let exe = g.build(&[&u]).unwrap().compile(&client).unwrap();
        let host_keys = [draw_key(1, 0, 0), draw_key(1, 1, 0), draw_key(u64::MAX, 7, 300)];
        let flat: Vec<u32> = host_keys.iter().flatten().copied().collect();
        let kb = client.buffer_from_host(&flat, &[3, 2], 0).unwrap();
        let got = exe.execute(&[&kb]).unwrap()[0].to_host::<f32>().unwrap();
        for (r, key) in host_keys.iter().enumerate() {
            for v in 0..41 {
                assert_eq!(
                    got[r * 41 + v],
                    draw_uniform(*key, v as u32, 41),
                    "row {r} entry {v}"
                );
            }
        }
        let mean = got.iter().sum::<f32>() / got.len() as f32;
        assert!((mean - 0.5).abs() < 0.1, "{mean}");
    }

    /// The host twin of [`inverse_cdf`] for one row: the first index whose running sum
    /// reaches `u * total`, in f64.
    fn host_inverse_cdf(mass: &[f32], u: f32) -> usize {
        let total: f64 = mass.iter().map(|&m| m as f64).sum();
        let target = u as f64 * total;
        let mut run = 0.0;
        for (i, &m) in mass.iter().enumerate() {
            run += m as f64;
            if run >= target && m > 0.0 {
                return i;
            }
        }
        mass.iter().rposition(|&m| m > 0.0).unwrap()
    }

    #[test]
    fn inverse_cdf_picks_the_entry_whose_running_sum_reaches_the_target() {
        let client = xla::runtime::Client::cpu(1).unwrap();
        // 3 rows of 600 entries (3 blocks of 256, the last one padded): a smooth row, a row
        // with mass only in a few scattered entries (zeros must never be picked), and a row
        // with all mass in the last entry.
        let (s, v) = (3usize, 600usize);
        let mut mass = vec![0f32; s * v];
        for (i, m) in mass[..v].iter_mut().enumerate() {
            *m = 1.0 + (i % 7) as f32;
        }
        for &i in &[3usize, 255, 256, 511, 599] {
            mass[v + i] = 0.25 + i as f32 / 1000.0;
        }
        mass[2 * v + v - 1] = 2.0;
        let g = xla::graph::Graph::new("inverse_cdf");
        let m = g.parameter("mass", DType::F32, &[s as i64, v as i64]);
        let u = g.parameter("u", DType::F32, &[s as i64]);
        let picked = inverse_cdf(&m, &u);
        let exe = g.build(&[&picked]).unwrap().compile(&client).unwrap();
        let mb = client.buffer_from_host(&mass, &[s as i64, v as i64], 0).unwrap();
        for &x in &[1e-7f32, 0.013, 0.25, 0.5, 0.7, 0.999, 0.9999999] {
            let us = vec![x; s];
            let ub = client.buffer_from_host(&us, &[s as i64], 0).unwrap();
            let got = exe.execute(&[&mb, &ub]).unwrap()[0].to_host::<i32>().unwrap();
            for r in 0..s {
                let row = &mass[r * v..(r + 1) * v];
                let want = host_inverse_cdf(row, x);
                assert_eq!(got[r] as usize, want, "row {r} u {x}");
                assert!(
                    row[got[r] as usize] > 0.0,
                    "row {r} u {x}: picked an entry of no mass"
                );
            }
        }
    }

    #[test]
    fn row_uniforms_use_word_zero_of_the_counter_zero_draw() {
        let client = xla::runtime::Client::cpu(1).unwrap();
        let g = xla::graph::Graph::new("row_uniform");
        let keys = g.parameter("keys", DType::U32, &[2, 2]);
        let u = row_uniform_graph(&keys);
        let exe = g.build(&[&u]).unwrap().compile(&client).unwrap();
        let host_keys = [draw_key(5, 0, 0), draw_key(5, 3, 9)];
        let flat: Vec<u32> = host_keys.iter().flatten().copied().collect();
        let kb = client.buffer_from_host(&flat, &[2, 2], 0).unwrap();
        let got = exe.execute(&[&kb]).unwrap()[0].to_host::<f32>().unwrap();
        assert_eq!(got, vec![row_uniform(host_keys[0]), row_uniform(host_keys[1])]);
        assert!(got.iter().all(|&x| x > 0.0 && x < 1.0) && got[0] != got[1]);
    }

    #[test]
    fn reference_distribution_truncates_like_vllm() {
        let logits = [(0.5f32).ln(), (0.3f32).ln(), (0.15f32).ln(), (0.05f32).ln()];
        let p = |top_k, top_p| {
            reference_distribution(
                &logits,
                &SamplingParams {
                    temperature: 1.0,
                    top_k,
                    top_p,
                    ..Default::default()
                },
            )
        };
        let full = p(0, 1.0);
        assert!((full[0] - 0.5).abs() < 1e-6 && (full[3] - 0.05).abs() < 1e-6);
        let k2 = p(2, 1.0);
        assert!((k2[0] - 0.625).abs() < 1e-6 && k2[2] == 0.0);
        // top-p 0.7: 0.5 < 0.7 so the second token is kept too; the third is not.
        let p7 = p(0, 0.7);
        assert!((p7[1] - 0.375).abs() < 1e-6 && p7[2] == 0.0);
        let greedy = reference_distribution(&logits, &SamplingParams::greedy(1));
        assert_eq!(greedy, vec![1.0, 0.0, 0.0, 0.0]);
        // min-p 0.5: tokens of probability >= 0.25 (half the best's 0.5) stay.
        let m = |min_p, top_p| {
            reference_distribution(
                &logits,
                &SamplingParams {
                    temperature: 1.0,
                    top_p,
                    min_p,
                    ..Default::default()
                },
            )
        };
        let m5 = m(0.5, 1.0);
        assert!((m5[0] - 0.625).abs() < 1e-6 && (m5[1] - 0.375).abs() < 1e-6 && m5[2] == 0.0);
        // Before top-p, as vLLM: min-p 0.2 keeps 0.5, 0.3, 0.15 (>= 0.1), renormalised to
        // 0.526, 0.316, 0.158; top-p 0.8 then keeps the first two (0.526 < 0.8, 0.842 >= 0.8).
        let m2 = m(0.2, 0.8);
        assert!(
            (m2[0] - 0.625).abs() < 1e-6 && m2[2] == 0.0 && m2[3] == 0.0,
            "{m2:?}"
        );
        assert!(SamplingParams {
            min_p: 0.1,
            ..Default::default()
        }
        .needs_truncation());
        assert!(SamplingParams {
            min_p: 1.5,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .contains("min_p"));
    }
}
