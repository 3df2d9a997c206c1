//! The mixture-of-experts MLP as three named steps, each a graph function:
//!
//! 1. [`route`]: the router's logits, softmax in f32, the chosen experts (top-k of the live
//!    probabilities, or a recorded choice replayed) and each token's combine weights over all
//!    experts, zero where not chosen. The weights are a function of the live probabilities
//!    whichever experts are chosen, so the router gets gradients under replay too.
//! 2. dispatch: which tokens reach which expert, by [`MoeLowering`]. The dense lowering
//!    ([`experts_dense`]) sends every token to every expert and lets the zero combine weights
//!    drop what was not chosen: dropless, exact, and `experts / k` times the FLOPs of the
//!    chosen experts, what the CPU plugin runs (it has no grouped product). The grouped
//!    lowering ([`experts_grouped`]) sorts each token's k (token, expert) pairs by expert and
//!    runs each expert over its own rows only, with XLA's ragged dot on TPU and GPU: dropless
//!    too, and the chosen experts' FLOPs.
//! 3. expert computation: each expert's SwiGLU over its tokens, weighted and summed.
//!
//! A family is a [`crate::MoeConfig`] plus, where it differs, a line here: Qwen3-MoE's router
//! is a bias-free linear with softmax-then-top-k; a shared expert or a dense branch beside the
//! experts (DeepSeek, Gemma 4) is one more term in [`moe_mlp`].
//!
//! Sharding: the stacked expert tensors are `[experts, ...]`; FSDP splits their first
//! dimension, the expert axis, so each device stores whole experts
//! ([`crate::ParamLayout::sharding`]); the dense lowering then gathers them as it gathers any
//! FSDP parameter.
//!
//! Routing replay: the prefill, decode and extend graphs return each fed position's chosen
//! experts, which the rollout records with its samples (`rollout::Sample::routes`) and the
//! learner replays (`trainer::bucket::BucketedLearner::pack_routed`, under
//! `actor.router_replay.mode`); a position marked [`NOT_RECORDED`] routes by its router. A
//! routed forward reports [`Routes`], from which [`load_balancing_loss`] and the router
//! metrics are computed. Published per-expert checkpoint tensors are stacked on load
//! (`stack_per_expert`).

use xla::graph::Tensor;
use xla::runtime::PluginKind;
use xla::DType;

use crate::config::MoeConfig;

/// How a mixture-of-experts layer dispatches its tokens to its experts (steps 2 and 3); the
/// same values and gradients either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MoeLowering {
    /// [`experts_dense`]: every token through every expert.
    #[default]
    Dense,
    /// [`experts_grouped`]: tokens sorted by expert through a grouped product; `native`: XLA's
    /// ragged dot (TPU, GPU), else its masked dense form (any plugin; for tests).
    Grouped { native: bool },
}

impl MoeLowering {
    /// This lowering on `plugin`'s devices: the grouped product through XLA's ragged dot where
    /// XLA compiles one (TPU, GPU), through its masked form on the CPU, whose XLA has none.
    pub fn on(self, plugin: PluginKind) -> MoeLowering {
        match self {
            MoeLowering::Dense => MoeLowering::Dense,
            MoeLowering::Grouped { .. } => MoeLowering::Grouped {
                native: plugin != PluginKind::Cpu,
            },
        }
    }
}

/// The traced parameters of one mixture-of-experts MLP, in transformers 5's stacked layout,
/// and how it is computed.
#[derive(Clone, Debug)]
pub struct Experts {
    /// `mlp.gate.weight` `[experts, hidden]`: the router.
    pub router: Tensor,
    /// `mlp.experts.gate_up_proj` `[experts, 2*ffn, hidden]`: each expert's gate rows, then its
    /// up rows.
    pub gate_up: Tensor,
    /// `mlp.experts.down_proj` `[experts, hidden, ffn]`.
    pub down: Tensor,
    /// The dispatch ([`crate::forward::DecoderParams::with_moe_lowering`]).
    pub lowering: MoeLowering,
}

/// The replay value of a position with no recorded choice: [`route`] takes the router's own.
pub const NOT_RECORDED: i32 = -1;

/// What [`route`] decided for a batch of tokens `[..]` (the input's leading dimensions).
#[derive(Clone, Debug)]
pub struct Routing {
    /// `[.., experts]` f32: 1 where the expert is chosen, else 0.
    pub selected: Tensor,
    /// `[.., experts]` f32: the router's logits.
    pub logits: Tensor,
    /// `[.., experts]` f32: the router's softmax.
    pub probs: Tensor,
    /// `[.., k]` i32: the chosen experts, in top-k order (or as replayed).
    pub chosen: Tensor,
    /// `[.., experts]` f32: each expert's combine weight, zero where not chosen.
    pub weights: Tensor,
}

/// Step 1: routes `x [.., hidden]` through `router` `[experts, hidden]`. With `replay`
/// (`[.., k]`, any signed integer type) those experts are used instead of the router's top-k,
/// position by position: a position whose replayed row starts with a negative id
/// ([`NOT_RECORDED`]) takes the router's own top-k (a token the rollout never fed through the
/// model, such as a response's last, or padding).
pub fn route(config: &MoeConfig, router: &Tensor, x: &Tensor, replay: Option<&Tensor>) -> Routing {
    let logits = x
        .convert_if_needed(DType::F32)
        .linear(&router.convert_if_needed(DType::F32));
    let probs = logits.softmax(-1);
    let own = probs.stop_gradient().top_k(config.experts_per_token as i64).1;
    let chosen = match replay {
        Some(r) => {
            let r = r.convert_if_needed(DType::I32);
            let recorded =
                r.slice_axis(r.rank() - 1, 0, 1)
                    .ge(&r.zeros_like().slice_axis(r.rank() - 1, 0, 1));
            recorded.broadcast_to(r.dims()).select(&r, &own)
        }
        None => own,
    };
    let selected = chosen_mask(config, &chosen);
    let kept = &probs * &selected;
    let weights = if config.norm_topk_prob {
        &kept / &kept.sum_axis(-1, true)
    } else {
        kept
    };
    Routing {
        selected,
        logits,
        probs,
        chosen,
        weights,
    }
}

/// `[.., E]` f32: 1 where `chosen` `[.., k]` names the expert. The combine weights are the
/// probabilities kept there (renormalised over the chosen ones when `norm_topk_prob`):
/// transformers' top-k values scattered to all experts.
fn chosen_mask(config: &MoeConfig, chosen: &Tensor) -> Tensor {
    let g = chosen.graph();
    let e = config.num_experts as i64;
    let rank = chosen.rank();
    let mut dims = chosen.dims().to_vec();
    dims.push(e);
    // [.., k, E]: one-hot of each choice, summed over k: a 0/1 mask of the chosen experts.
    let experts = g.iota(DType::I32, &dims, rank);
    let hit = chosen.keep_axis(rank).broadcast_to(&dims).eq(&experts);
    hit.select(&g.full(1.0, DType::F32, &[]), &g.full(0.0, DType::F32, &[]))
        .sum_axis(rank as i64 - 1, false)
}

/// Steps 2 and 3, the dense lowering: every expert's SwiGLU over every token of `x [N, hidden]`,
/// combined by `weights [N, experts]` (zero for experts not chosen). The result is f32
/// `[N, hidden]`. Narrow (bf16/f16) expert weights take narrow operands and give f32 products.
///
/// Both products are plain matrix products over the experts' rows laid side by side (the
/// stacked tensors reshaped, the down projection's experts moved next to its inner dimension):
/// the CPU plugin runs a bf16 product with an f32 result only in that form, and the gradients'
/// products stay in it too.
pub fn experts_dense(experts: &Experts, x: &Tensor, weights: &Tensor) -> Tensor {
    let [e, two_f, h] = experts.gate_up.dims()[..] else {
        panic!("stacked experts are [experts, 2 * ffn, hidden]");
    };
    let f = two_f / 2;
    let n = x.dims()[0];
    // [N, H] . [E * 2F, H]^T -> [N, E, 2F]
    let gate_up = x
        .linear(&experts.gate_up.reshape(&[e * two_f, h]))
        .reshape(&[n, e, two_f]);
    let gate = gate_up.slice_axis(2, 0, f);
    let up = gate_up.slice_axis(2, f, two_f);
    let act = &gate.silu() * &up;
    let weighted = &act * &weights.keep_axis(2).broadcast_to(act.dims());
    // [N, E * F] . ([E, H, F] -> [H, E * F])^T -> [N, H], summing over experts and their width.
    let down = experts.down.transpose(&[1, 0, 2]).reshape(&[h, e * f]);
    weighted.reshape(&[n, e * f]).linear(&down)
}

/// Steps 2 and 3, the grouped lowering: the `N * k` (token, expert) pairs of `x [N, hidden]`
/// and `routing` sorted by expert (stable, so tokens keep their order within an expert), each
/// expert's SwiGLU over its own pairs by two grouped products (`native`: XLA's ragged dot),
/// each pair's output weighted by its combine weight and added into its token's row. The
/// result is f32 `[N, hidden]`, equal to [`experts_dense`]'s (whose other experts' weights are
/// zero). Narrow expert weights take narrow operands and give f32 products.
pub fn experts_grouped(experts: &Experts, x: &Tensor, routing: &Routing, native: bool) -> Tensor {
    let [e, two_f, h] = experts.gate_up.dims()[..] else {
        panic!("stacked experts are [experts, 2 * ffn, hidden]");
    };
    let f = two_f / 2;
    let g = x.graph();
    let (n, k) = (x.dims()[0], routing.chosen.dims()[1]);
    let pairs = n * k;
    // Dispatch: pair p = token p / k's (p % k)-th choice; sorted by expert.
    let chosen = routing.chosen.reshape(&[pairs]);
    let (by_expert, order) = chosen.sort(false);
    let token = &order / &order.full_like(k as f64);
    let sizes = by_expert
        .keep_axis(1)
        .broadcast_to(&[pairs, e])
        .eq(&g.iota(DType::I32, &[pairs, e], 1))
        .select(&g.scalar(1.0, DType::I32), &g.scalar(0.0, DType::I32))
        .sum_axis(0, false);
    // The masked form's products are three-dimensional, which the CPU plugin runs in f32 only
    // (bf16 x bf16 = f32 is refused there): it computes in f32.
    let w = if native {
        experts.gate_up.dtype()
    } else {
        DType::F32
    };
    let rows = x.take(&token, 0).convert_if_needed(w);
    let stacked = |t: &Tensor| t.convert_if_needed(w).transpose(&[0, 2, 1]);
    // Each expert's SwiGLU over its rows: [P, H] x [E, H, 2F] -> [P, 2F], then [P, F] x [E, F, H].
    let gate_up = rows.ragged_dot(&stacked(&experts.gate_up), &sizes, native, Some(DType::F32));
    let act = &gate_up.slice_axis(1, 0, f).silu() * &gate_up.slice_axis(1, f, two_f);
    let out = act
        .convert_if_needed(w)
        .ragged_dot(&stacked(&experts.down), &sizes, native, Some(DType::F32));
    // Combine: each pair's combine weight (the router's, live) and a sum into its token.
    let at = Tensor::concat(&[&token.keep_axis(1), &by_expert.keep_axis(1)], 1);
    let weight = routing.weights.take_at(&at, &[0, 1]);
    let weighted = &out * &weight.keep_axis(1).broadcast_to(&[pairs, h]);
    g.zeros(DType::F32, &[n, h])
        .scatter_add_at(&token, &weighted, &[0])
}

/// The mixture-of-experts MLP of `x [.., hidden]`: routed (or replayed), dispatched by the
/// experts' [`MoeLowering`],
/// f32 `[.., hidden]`, with the routing for metrics, losses and recording.
pub fn moe_mlp(
    config: &MoeConfig,
    experts: &Experts,
    x: &Tensor,
    replay: Option<&Tensor>,
) -> (Tensor, Routing) {
    let dims = x.dims().to_vec();
    let hidden = dims[dims.len() - 1];
    let flat = x.reshape(&[-1, hidden]);
    let replay_flat = replay.map(|r| r.reshape(&[-1, config.experts_per_token as i64]));
    let routing = route(config, &experts.router, &flat, replay_flat.as_ref());
    let out = match experts.lowering {
        MoeLowering::Dense => experts_dense(experts, &flat, &routing.weights),
        MoeLowering::Grouped { native } => experts_grouped(experts, &flat, &routing, native),
    };
    let lead = &dims[..dims.len() - 1];
    let reshape = |t: &Tensor, last: i64| {
        let mut d = lead.to_vec();
        d.push(last);
        t.reshape(&d)
    };
    let e = config.num_experts as i64;
    let routing = Routing {
        selected: reshape(&routing.selected, e),
        logits: reshape(&routing.logits, e),
        probs: reshape(&routing.probs, e),
        chosen: reshape(&routing.chosen, config.experts_per_token as i64),
        weights: reshape(&routing.weights, e),
    };
    (reshape(&out, hidden), routing)
}

/// A forward pass's routing over positions `[..]` (one list for every MoE layer, in layer
/// order `Lm`): what the layers chose, and the sums a step's router metrics and the
/// load-balancing loss are made of, over the positions marked valid.
#[derive(Clone, Debug)]
pub struct Routes {
    /// `[.., Lm, k]` i32: each position's experts in every MoE layer.
    pub chosen: Tensor,
    /// `[Lm, E]` f32: valid positions sent to each expert (a position counts once per chosen
    /// expert, so a layer's row sums to `k` times the valid positions).
    pub tokens_per_expert: Tensor,
    /// `[Lm, E]` f32: the router's probabilities summed over valid positions.
    pub prob_sum: Tensor,
    /// `[Lm]` f32: the router's entropy summed over valid positions.
    pub entropy_sum: Tensor,
}

/// What [`Routes`] sums for one layer, from its [`Routing`] over `[N]` flat positions and their
/// validity `valid [N]` (f32 0/1): `(tokens_per_expert [E], prob_sum [E], entropy_sum [])`.
pub fn layer_sums(routing: &Routing, valid: &Tensor) -> (Tensor, Tensor, Tensor) {
    let e = routing.probs.dims()[routing.probs.rank() - 1];
    let probs = routing.probs.reshape(&[-1, e]);
    let n = probs.dims()[0];
    let v = valid.reshape(&[n, 1]).broadcast_to(&[n, e]);
    let tokens = (&routing.selected.reshape(&[-1, e]) * &v).sum_axis(0, false);
    let prob_sum = (&probs * &v).sum_axis(0, false);
    // Entropy from the log-softmax of the logits: finite where a probability underflows.
    let log_p = routing.logits.reshape(&[-1, e]).log_softmax(-1);
    let entropy = (&(&probs * &log_p) * &v).sum_all();
    (tokens, prob_sum, &entropy * &entropy.scalar_like(-1.0))
}

/// The load-balancing loss of transformers' `load_balancing_loss_func` over every MoE layer
/// (Switch Transformer, eqs. 4-6): `E * sum_e f_e * P_e`, with `f_e` the fraction of routed
/// (position, choice) pairs sent to expert `e` over all layers and `P_e` the mean router
/// probability of `e`, both over the valid positions of all layers. Under replay `f` counts the
/// replayed choices. The gradient reaches the routers through `P` only, as in transformers.
pub fn load_balancing_loss(config: &MoeConfig, routes: &Routes, valid_positions: &Tensor) -> Tensor {
    let layers = routes.prob_sum.dims()[0] as f64;
    let valid = valid_positions.convert_if_needed(DType::F32);
    let rows = (&valid * &valid.scalar_like(layers)).broadcast_to(&[config.num_experts as i64]);
    let f = &routes.tokens_per_expert.sum_axis(0, false) / &rows;
    let p = &routes.prob_sum.sum_axis(0, false) / &rows;
    let loss = (&f.stop_gradient() * &p).sum_all();
    &loss * &loss.scalar_like(config.num_experts as f64)
}

/// The published checkpoints' per-expert tensor `model.layers.{layer}.mlp.experts.{e}.{proj}.weight`:
/// `(layer, e, proj)`, where `proj` is `gate_proj`, `up_proj` or `down_proj`.
fn per_expert_name(name: &str) -> Option<(usize, usize, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let rest = rest.strip_prefix("mlp.experts.")?;
    let (e, rest) = rest.split_once('.')?;
    let proj = rest.strip_suffix(".weight")?;
    matches!(proj, "gate_proj" | "up_proj" | "down_proj").then_some(())?;
    Some((layer.parse().ok()?, e.parse().ok()?, proj))
}

/// Whether `name` is a per-expert tensor of a mixture-of-experts layer of `config`.
pub(crate) fn is_per_expert_tensor(config: &crate::ModelConfig, name: &str) -> bool {
    per_expert_name(name).is_some_and(|(layer, _, _)| config.is_moe_layer(layer))
}

/// Stacks the per-expert tensors in `per_expert` (names accepted by [`is_per_expert_tensor`]) into
/// transformers 5's `mlp.experts.gate_up_proj` `[E, 2F, H]` (each expert's gate rows, then its up
/// rows) and `mlp.experts.down_proj` `[E, H, F]`, inserted into `found`. Each expert's tensor
/// must be there with its shape, and no expert past the config's count.
pub(crate) fn stack_per_expert(
    config: &crate::ModelConfig,
    per_expert: std::collections::HashMap<String, crate::HostTensor>,
    found: &mut std::collections::HashMap<String, crate::HostTensor>,
    origin: &str,
) -> crate::error::Result<()> {
    use crate::error::ModelError;
    let Some(moe) = config.moe.as_ref() else {
        return Ok(());
    };
    let mut layers: Vec<usize> = per_expert
        .keys()
        .filter_map(|n| per_expert_name(n).map(|(l, _, _)| l))
        .collect();
    layers.sort_unstable();
    layers.dedup();
    let (e_count, f, h) = (moe.num_experts, moe.expert_intermediate_size, config.hidden_size);
    if let Some((name, t)) = per_expert
        .iter()
        .find(|(n, _)| per_expert_name(n).is_some_and(|(_, e, _)| e >= e_count))
    {
        return Err(ModelError::UnexpectedTensor {
            name: name.clone(),
            found: t.shape.clone(),
            origin: origin.to_string(),
            family: format!("{} ({e_count} experts)", config.family),
        });
    }
    let mut per_expert = per_expert;
    for layer in layers {
        let mut take = |e: usize, proj: &str, shape: [usize; 2]| {
            let name = format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight");
            let t = per_expert
                .remove(&name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: name.clone(),
                    expected: shape.to_vec(),
                    origin: origin.to_string(),
                })?;
            if t.shape != shape {
                return Err(ModelError::ShapeMismatch {
                    name,
                    expected: shape.to_vec(),
                    found: t.shape,
                    origin: origin.to_string(),
                });
            }
            Ok(t)
        };
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        let mut dtype = None;
        for e in 0..e_count {
            for (proj, shape) in [("gate_proj", [f, h]), ("up_proj", [f, h]), ("down_proj", [h, f])] {
                let t = take(e, proj, shape)?;
                let out = if proj == "down_proj" {
                    &mut down
                } else {
                    &mut gate_up
                };
                // Mixed element types across experts would need a conversion no checkpoint needs.
                let t = match dtype {
                    None => {
                        dtype = Some(t.dtype);
                        t
                    }
                    Some(d) => t.to_dtype(d),
                };
                out.extend_from_slice(&t.bytes);
            }
        }
        let dtype = dtype.expect("at least one expert");
        let prefix = format!("model.layers.{layer}.mlp.experts");
        for (name, shape, bytes) in [
            (format!("{prefix}.gate_up_proj"), vec![e_count, 2 * f, h], gate_up),
            (format!("{prefix}.down_proj"), vec![e_count, h, f], down),
        ] {
            let t =
                crate::HostTensor::from_le_bytes(&name, dtype, shape, bytes).expect("whole experts stacked");
            if found.insert(name.clone(), t).is_some() {
                return Err(ModelError::UnexpectedTensor {
                    name: format!("{name} (and the per-expert tensors it stacks)"),
                    found: Vec::new(),
                    origin: origin.to_string(),
                    family: format!("{} (one layout per layer)", config.family),
                });
            }
        }
    }
    Ok(())
}
