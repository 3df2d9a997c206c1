//! The policy the learner trains: a decoder from the `model` crate, seen through the per-token
//! log-probabilities of its responses.
//!
//! A training row is one prompt followed by one response. GRPO samples `n` responses per
//! prompt, so a micro-batch is packed as its distinct prompts (`U` of them, left-padded to
//! `P = prompt_len` columns) and its responses (`micro_batch_size` of them, right-padded to
//! `L = response_len` columns), each response naming its prompt: every prompt runs through the
//! model once and its responses attend to its keys and values
//! ([`model::forward::logprobs_graph_shared_prompts`]). For the quickstart's 4 prompts x 8
//! samples of 48 + 16 tokens that is 704 token columns per pass instead of 2,048.
//!
//! Rows come in groups of [`DecoderPolicy::group_size`] consecutive rows with one prompt (1:
//! every row its own prompt). With the rows split over [`DecoderPolicy::blocks`] devices, each
//! device's rows and prompts form one block ([`model::forward::SharedPrompts`]). The number of
//! prompt slots follows from those ([`DecoderPolicy::prompt_slots`]); a micro-batch with more
//! distinct prompts than that (groups not in that order, or cut short) is packed by the policy
//! [`DecoderPolicy::unshared`], which has a slot per row. With a slot per row (no groups, or
//! one row per block) the policy runs each row whole, prompt then response, through
//! [`model::forward::logprobs_graph_span`]: the same numbers, and faster when nothing is shared.
//!
//! The policy's output column `j` is `log p(response[j] | prompt, response[<j])` at the
//! sampling temperature, exactly the quantity the rollout reports for the same token: the
//! response's positions continue the prompt's real length, so left padding moves nothing.
//!
//! Variants of the same packing and trunk: with [`Head::Value`] the model is a value model
//! (PPO's critic), read by `model::classifier::values_graph` at the positions the log-probs
//! are read at and trained by the clipped value loss in the same programs; with
//! [`DecoderPolicy::lora`] its parameters are the adapters and its frozen tensors the base
//! weights, run merged or, with [`DecoderPolicy::lora_form`] applied, beside the base (so the
//! reference is the base with zero adapters); with [`DecoderPolicy::remat`] its layers are
//! recomputed in the backward pass; with [`DecoderPolicy::route_inputs`] a mixture of experts
//! replays the rollout's routes ([`DecoderPolicy::pack_routed`]).

use crate::step::{HostArray, InputSpec, PolicyOutput, RouterTerms};
use model::classifier::{value_head_table, value_model_param_table, values_graph};
use model::forward::{
    logprobs_graph_shared_prompts, logprobs_graph_shared_prompts_routed, logprobs_graph_span,
    logprobs_graph_span_routed, shared_prompts_hidden_graph, span_hidden_graph, DecoderParams, SharedPrompts,
};
use model::lora::{lora_param_table, merge_params, LoraConfig};
use model::{param_table, ModelConfig, ParamSpec};
use xla::graph::Tensor;
use xla::DType;

/// What reads the decoder's final hidden states.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Head {
    /// The output head: each response token's log-prob at the sampling temperature (a policy).
    #[default]
    LogProbs,
    /// A value head, `score.weight [1, hidden]` and `score.bias [1]` on the trunk (a value
    /// model, VeRL's PPO critic, as transformers' `*ForTokenClassification` stores it): each
    /// response column's value, read at the position that predicts that column's token, as
    /// VeRL's critic reads `values[:, -response_length - 1 : -1]`.
    Value,
}

/// A decoder policy with static training shapes.
#[derive(Clone, Debug)]
pub struct DecoderPolicy {
    pub config: ModelConfig,
    /// Prompt columns `P` (prompts are left-padded to it).
    pub prompt_len: usize,
    /// Response columns `L` (responses are right-padded to it).
    pub response_len: usize,
    /// Rows per forward/backward pass.
    pub micro_batch_size: usize,
    /// The sampling temperature the log-probs are taken at (logits / T).
    pub temperature: f32,
    /// Consecutive rows that share one prompt (GRPO's `rollout.n`); 1: no sharing.
    pub group_size: usize,
    /// Blocks the rows and prompts are cut into (the learner's devices; 1 on one device).
    pub blocks: usize,
    /// Recompute each decoder layer's activations in the backward pass instead of keeping
    /// them ([`DecoderParams::remat`]; `model.enable_gradient_checkpointing`).
    pub remat: bool,
    /// Trace the decoder layers once, as a loop over their stacked parameters
    /// ([`DecoderParams::scan`]; `model.scan_layers`).
    pub scan: bool,
    /// Train LoRA adapters on a frozen base instead of every weight (`actor.lora_rank`): the
    /// trainable parameters are the adapters ([`model::lora::lora_param_table`]), the base
    /// weights are the learner's frozen tensors ([`DecoderPolicy::frozen_specs`]), and the
    /// forward pass runs on `W + s·B·A` ([`model::lora::merge_params`]) or, with
    /// [`DecoderPolicy::lora_form`] applied, with the adapters beside the base weights.
    pub lora: Option<LoraConfig>,
    /// How the forward pass computes with the adapters (read only with [`DecoderPolicy::lora`]).
    pub lora_form: model::LoraForm,
    /// What the model computes per response column: log-probs (a policy) or values (a critic;
    /// without LoRA).
    pub head: Head,
    /// Routing replay for a mixture-of-experts policy: the batch carries each position's
    /// experts for every MoE layer (`prompt_routes` `[U, P, Lm, k]`, `response_routes`
    /// `[micro_batch_size, L, Lm, k]`, [`model::moe::NOT_RECORDED`] where the router chooses),
    /// every pass uses them, and the log-probs pass returns the experts it used
    /// ([`PolicyOutput::chosen`]). Read only for a mixture-of-experts model.
    pub route_inputs: bool,
    /// How a mixture-of-experts model's layers dispatch to their experts
    /// (`model.moe_dispatch`); the learner lowers its ragged dot for its plugin
    /// ([`DecoderPolicy::for_plugin`]).
    pub moe_lowering: model::moe::MoeLowering,
}

/// One micro-batch of rows packed for [`DecoderPolicy`].
#[derive(Clone, Debug, PartialEq)]
pub struct PackedRows {
    /// Distinct prompts `[U, P]`, left-padded (unused slots all padding).
    pub prompts: Vec<i32>,
    /// `[U, P]`: 1 on real prompt tokens.
    pub prompt_mask: Vec<i32>,
    /// Responses `[micro_batch_size, L]`, right-padded.
    pub responses: Vec<i32>,
    /// `[micro_batch_size, L]`: 1.0 on real response tokens.
    pub response_mask: Vec<f32>,
    /// `[micro_batch_size]`: each row's prompt, counted from the start of its block.
    pub prompt_index: Vec<i32>,
    /// With [`DecoderPolicy::route_inputs`]: the experts to replay at each prompt position,
    /// `[U, P, Lm, k]` ([`model::moe::NOT_RECORDED`] where none is); else empty.
    pub prompt_routes: Vec<i32>,
    /// With [`DecoderPolicy::route_inputs`]: the same for the responses,
    /// `[micro_batch_size, L, Lm, k]`; else empty.
    pub response_routes: Vec<i32>,
}

impl PackedRows {
    /// The policy inputs, in [`DecoderPolicy::input_specs`] order; the routes too when
    /// `with_routes` (the policy replays them, [`DecoderPolicy::replays`]; a critic sharing a
    /// policy's packings reads none).
    pub fn inputs(&self, with_routes: bool) -> Vec<HostArray> {
        let mut inputs = vec![
            HostArray::I32(self.prompts.clone()),
            HostArray::I32(self.prompt_mask.clone()),
            HostArray::I32(self.responses.clone()),
            HostArray::I32(self.response_mask.iter().map(|&m| (m != 0.0) as i32).collect()),
            HostArray::I32(self.prompt_index.clone()),
        ];
        if with_routes {
            inputs.push(HostArray::I32(self.prompt_routes.clone()));
            inputs.push(HostArray::I32(self.response_routes.clone()));
        }
        inputs
    }
}

/// A row that does not fit the policy's shapes.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("row {row}: the prompt has {len} tokens, more than the {max} the learner was built for (data.max_prompt_length)")]
    PromptTooLong { row: usize, len: usize, max: usize },
    #[error("row {row}: the response has {len} tokens, more than the {max} the learner was built for (data.max_response_length)")]
    ResponseTooLong { row: usize, len: usize, max: usize },
    #[error("row {row}: the prompt is empty; a response needs at least one token to follow")]
    EmptyPrompt { row: usize },
    #[error("{rows} rows given; a micro-batch holds {max} (actor.ppo_micro_batch_size)")]
    TooManyRows { rows: usize, max: usize },
    #[error("row {row}: its recorded routes {problem} (rollout.enable_rollout_routing_replay records them for this model)")]
    Routes { row: usize, problem: String },
    #[error("rows {first}..{end} hold {distinct} distinct prompts; the learner packs at most {slots} per block of rows (rows must come in groups of {group} with one prompt)")]
    TooManyPrompts {
        first: usize,
        end: usize,
        distinct: usize,
        slots: usize,
        group: usize,
    },
}

/// The most distinct prompts `rows` consecutive rows can hold when groups of `group` rows
/// share one and the rows start at a multiple of `rows` (a block of a micro-batch).
fn prompts_in(rows: usize, group: usize) -> usize {
    if group <= 1 || rows <= 1 {
        rows
    } else if rows.is_multiple_of(group) {
        rows / group
    } else if group.is_multiple_of(rows) {
        1
    } else {
        (1 + (rows - 1).div_ceil(group)).min(rows)
    }
}

impl DecoderPolicy {
    /// This policy with `prompt_len` prompt and `response_len` response columns (a length
    /// bucket; see [`crate::bucket`]): the same model, micro-batch, temperature and sharing.
    pub fn with_lengths(&self, prompt_len: usize, response_len: usize) -> DecoderPolicy {
        DecoderPolicy {
            prompt_len,
            response_len,
            ..self.clone()
        }
    }

    /// This policy on `plugin`'s devices ([`model::moe::MoeLowering::on`]).
    pub fn for_plugin(&self, plugin: xla::runtime::PluginKind) -> DecoderPolicy {
        DecoderPolicy {
            moe_lowering: self.moe_lowering.on(plugin),
            ..self.clone()
        }
    }

    /// This policy with a prompt slot per row: packs any rows.
    pub fn unshared(&self) -> DecoderPolicy {
        DecoderPolicy {
            group_size: 1,
            ..self.clone()
        }
    }

    fn rows_per_block(&self) -> usize {
        self.micro_batch_size / self.blocks.max(1)
    }

    /// Prompt slots per block of rows.
    fn slots_per_block(&self) -> usize {
        prompts_in(self.rows_per_block(), self.group_size)
    }

    /// `U`: the prompt slots of a micro-batch (the first dimension of the prompt inputs).
    pub fn prompt_slots(&self) -> usize {
        self.blocks.max(1) * self.slots_per_block()
    }

    /// Whether rows share prompt slots (fewer slots than rows). Without sharing, row `r`'s
    /// prompt is slot `r` and the model runs each row whole (the same result; the whole-row
    /// program is the faster one when nothing is shared: BENCHMARKS.md).
    pub fn shares_prompts(&self) -> bool {
        self.prompt_slots() < self.micro_batch_size
    }

    /// The trainable parameters: the model's parameter table (Hugging Face names), or with
    /// LoRA the adapters (PEFT's names).
    pub fn param_specs(&self) -> Vec<ParamSpec> {
        match (&self.lora, self.head) {
            (_, Head::Value) => value_model_param_table(&self.config),
            (Some(lora), Head::LogProbs) => lora_param_table(&self.config, lora),
            (None, Head::LogProbs) => param_table(&self.config),
        }
    }

    /// Parameters at which the policy is its base model whatever the weights: with LoRA zero
    /// adapters (`B = 0` merges to `W` exactly), the KL reference with no second copy of the
    /// weights; `None` for a full fine-tune, whose reference is its initial weights.
    pub fn base_params(&self) -> Option<Vec<Vec<f32>>> {
        self.lora
            .as_ref()
            .map(|_| self.param_specs().iter().map(|p| vec![0.0; p.numel()]).collect())
    }

    /// The tensors the policy reads but does not train (`StepConfig::frozen`): with LoRA the
    /// base model's parameter table, else none.
    pub fn frozen_specs(&self) -> Vec<ParamSpec> {
        match &self.lora {
            Some(_) => param_table(&self.config),
            None => Vec::new(),
        }
    }

    /// The batch inputs (all i32): `prompts` and `prompt_mask` `[U, P]`, `responses` and
    /// `response_mask` `[micro_batch_size, L]`, `prompt_index` `[micro_batch_size]`; with
    /// [`DecoderPolicy::replays`], `prompt_routes` `[U, P, Lm, k]` and `response_routes`
    /// `[micro_batch_size, L, Lm, k]`.
    pub fn input_specs(&self) -> Vec<InputSpec> {
        let prompts = vec![self.prompt_slots() as i64, self.prompt_len as i64];
        let responses = vec![self.micro_batch_size as i64, self.response_len as i64];
        let spec = |name: &str, dims: &Vec<i64>| InputSpec {
            name: name.into(),
            dtype: DType::I32,
            dims: dims.clone(),
        };
        let mut specs = vec![
            spec("prompts", &prompts),
            spec("prompt_mask", &prompts),
            spec("responses", &responses),
            spec("response_mask", &responses),
            spec("prompt_index", &vec![self.micro_batch_size as i64]),
        ];
        if let Some(per_position) = self.routes_per_position() {
            let routed = |dims: &Vec<i64>| [dims.as_slice(), &per_position].concat();
            specs.push(spec("prompt_routes", &routed(&prompts)));
            specs.push(spec("response_routes", &routed(&responses)));
        }
        specs
    }

    /// Whether the batch carries routes to replay ([`DecoderPolicy::route_inputs`] on a
    /// mixture-of-experts model).
    pub fn replays(&self) -> bool {
        self.routes_per_position().is_some()
    }

    /// `[Lm, k]`: the experts a position has in the routes, when the policy replays them.
    fn routes_per_position(&self) -> Option<[i64; 2]> {
        let moe = self
            .config
            .moe
            .as_ref()
            .filter(|_| self.route_inputs && self.head == Head::LogProbs)?;
        Some([self.config.moe_layers() as i64, moe.experts_per_token as i64])
    }

    /// The model function for [`crate::step::build_train_programs`], by [`DecoderPolicy::head`]:
    /// [`DecoderPolicy::log_probs`] or [`DecoderPolicy::values`].
    pub fn forward(&self, params: &[Tensor], batch: &[Tensor]) -> PolicyOutput {
        match self.head {
            Head::LogProbs => self.log_probs(params, batch),
            Head::Value => self.values(params, batch),
        }
    }

    /// A value model's per-token values of the response columns, `[micro_batch_size, L]` (in
    /// [`PolicyOutput::log_probs`]; no entropy), 0 where a column is not valid. `params`
    /// follow [`model::classifier::value_model_param_table`].
    pub fn values(&self, params: &[Tensor], batch: &[Tensor]) -> PolicyOutput {
        let mut trunk = self.config.clone();
        trunk.tie_word_embeddings = true;
        let n = params.len() - value_head_table(&self.config).len();
        let mut p = DecoderParams::from_tensors(&trunk, &params[..n])
            .expect("parameters follow the value model's table")
            .with_moe_lowering(self.moe_lowering);
        p.remat = self.remat;
        p.scan = self.scan;
        let (h, valid) = if self.shares_prompts() {
            let shared = SharedPrompts::from_inputs(&batch[..5], self.blocks.max(1) as i64);
            shared_prompts_hidden_graph(batch[0].graph(), &p, &shared)
        } else {
            let tokens = Tensor::concat(&[&batch[0], &batch[2]], 1);
            let mask = Tensor::concat(&[&batch[1], &batch[3]], 1);
            span_hidden_graph(&p, &tokens, &mask, self.prompt_len as i64)
        };
        PolicyOutput {
            log_probs: &values_graph(&h, &params[n], &params[n + 1]) * &valid,
            entropy: None,
            router: None,
            chosen: None,
        }
    }

    /// The policy's per-token log-probs and entropies of the response columns,
    /// `[micro_batch_size, L]`. With LoRA, `params` are the adapters followed by the frozen base
    /// table.
    pub fn log_probs(&self, params: &[Tensor], batch: &[Tensor]) -> PolicyOutput {
        let g = batch[0].graph();
        let table = "parameters follow the parameter table";
        let p = match &self.lora {
            Some(lora) => {
                let (adapters, base) = params.split_at(lora_param_table(&self.config, lora).len());
                match self.lora_form {
                    model::LoraForm::Merged => {
                        let ((projections, merged_in), (experts, per_layer)) =
                            model::lora::split_experts(&self.config, lora, adapters);
                        let merged = merge_params(&self.config, &projections, base, &merged_in);
                        DecoderParams::from_tensors(&self.config, &merged)
                            .and_then(|p| p.with_adapters(&experts, &per_layer))
                            .expect(table)
                    }
                    model::LoraForm::Applied => DecoderParams::from_tensors(&self.config, base)
                        .and_then(|p| p.with_adapters(lora, adapters))
                        .expect(table),
                }
            }
            None => DecoderParams::from_tensors(&self.config, params).expect(table),
        };
        let mut p = p.with_moe_lowering(self.moe_lowering);
        p.remat = self.remat;
        p.scan = self.scan;
        let temperature = g.scalar(self.temperature as f64, DType::F32);
        let moe = self.config.moe.is_some();
        let count = |masks: &[&Tensor]| {
            masks
                .iter()
                .map(|m| m.convert_if_needed(DType::F32).sum_all())
                .reduce(|a, b| &a + &b)
                .expect("at least one mask")
        };
        // With routing replay, the experts to use: the prompts' `[U, P, Lm, k]` and the
        // responses' `[B, L, Lm, k]`.
        let replay = self.replays().then(|| (&batch[5], &batch[6]));
        let (u, pl) = (self.prompt_slots() as i64, self.prompt_len as i64);
        let (b, l) = (self.micro_batch_size as i64, self.response_len as i64);
        let per_position = |rows: i64, cols: i64| -> Vec<i64> {
            let [lm, k] = self.routes_per_position().expect("replays");
            vec![rows, cols, lm, k]
        };
        if !self.shares_prompts() {
            // Rows whole: prompt columns then response columns.
            let tokens = Tensor::concat(&[&batch[0], &batch[2]], 1);
            let mask = Tensor::concat(&[&batch[1], &batch[3]], 1);
            let from = self.prompt_len as i64;
            if moe {
                let replay = replay.map(|(prompts, responses)| Tensor::concat(&[prompts, responses], 1));
                let (lp, ent, routes) =
                    logprobs_graph_span_routed(g, &p, &tokens, &mask, &temperature, from, replay.as_ref());
                let chosen = routes.as_ref().filter(|_| self.replays()).map(|r| {
                    [
                        r.chosen.slice_axis(1, 0, pl).reshape(&per_position(b, pl)),
                        r.chosen.slice_axis(1, pl, pl + l).reshape(&per_position(b, l)),
                    ]
                });
                let router = routes.map(|r| RouterTerms::of(&self.config, &r, &count(&[&mask])));
                return PolicyOutput {
                    log_probs: lp,
                    entropy: Some(ent),
                    router,
                    chosen,
                };
            }
            let (lp, ent) = logprobs_graph_span(g, &p, &tokens, &mask, &temperature, from);
            return PolicyOutput {
                log_probs: lp,
                entropy: Some(ent),
                router: None,
                chosen: None,
            };
        }
        let mut shared = SharedPrompts::from_inputs(&batch[..5], self.blocks.max(1) as i64);
        shared.replay = replay;
        if moe {
            let (lp, ent, routes) = logprobs_graph_shared_prompts_routed(g, &p, &shared, &temperature);
            // Routes over the prompts' `U * P` positions, then the responses' `B * L`.
            let chosen = routes.as_ref().filter(|_| self.replays()).map(|r| {
                [
                    r.chosen.slice_axis(0, 0, u * pl).reshape(&per_position(u, pl)),
                    r.chosen
                        .slice_axis(0, u * pl, u * pl + b * l)
                        .reshape(&per_position(b, l)),
                ]
            });
            let router = routes.map(|r| RouterTerms::of(&self.config, &r, &count(&[&batch[1], &batch[3]])));
            return PolicyOutput {
                log_probs: lp,
                entropy: Some(ent),
                router,
                chosen,
            };
        }
        let (lp, ent) = logprobs_graph_shared_prompts(g, &p, &shared, &temperature);
        PolicyOutput {
            log_probs: lp,
            entropy: Some(ent),
            router: None,
            chosen: None,
        }
    }

    /// Pack up to `micro_batch_size` `(prompt, response)` rows. Rows past the end of `rows`
    /// are padding whose response mask is 0, so they contribute nothing. Equal prompts within
    /// a block share a slot, in order of first appearance. A policy that replays routes
    /// ([`DecoderPolicy::replays`]) gets none to replay: its router chooses everywhere.
    pub fn pack(&self, rows: &[(&[u32], &[u32])]) -> Result<PackedRows, PackError> {
        self.pack_routed(rows, None)
    }

    /// [`DecoderPolicy::pack`] with each row's recorded routes (`routes[r]`, row-major
    /// `[positions, Lm, k]` over the row's first positions, prompt then response, as
    /// `rollout::Sample::routes` holds them) for a policy that replays them; positions past a
    /// record (and rows without one) are [`model::moe::NOT_RECORDED`]. A shared prompt takes the
    /// routes of the first row that names it.
    pub fn pack_routed(
        &self,
        rows: &[(&[u32], &[u32])],
        routes: Option<&[Vec<u8>]>,
    ) -> Result<PackedRows, PackError> {
        let mut out = self.pack_tokens(rows)?;
        let Some([lm, k]) = self.routes_per_position() else {
            return Ok(out);
        };
        let per = (lm * k) as usize;
        let (p, l) = (self.prompt_len, self.response_len);
        out.prompt_routes = vec![model::moe::NOT_RECORDED; self.prompt_slots() * p * per];
        out.response_routes = vec![model::moe::NOT_RECORDED; self.micro_batch_size * l * per];
        let Some(routes) = routes else {
            return Ok(out);
        };
        let experts = self.config.moe.as_ref().expect("replays").num_experts;
        let mut filled = vec![false; self.prompt_slots()];
        for (row, ((prompt, response), record)) in rows.iter().zip(routes).enumerate() {
            let bad = |problem: String| PackError::Routes { row, problem };
            if !record.len().is_multiple_of(per) {
                return Err(bad(format!(
                    "hold {} expert ids, not a whole number of positions of {lm} MoE layers x {k} experts",
                    record.len()
                )));
            }
            let positions = record.len() / per;
            if positions > prompt.len() + response.len() {
                return Err(bad(format!(
                    "cover {positions} positions; the row has {} tokens",
                    prompt.len() + response.len()
                )));
            }
            if let Some(&e) = record.iter().find(|&&e| e as usize >= experts) {
                return Err(bad(format!("name expert {e}; the model has {experts}")));
            }
            let slot = self.slot_of(&out, row);
            for (i, ids) in record.chunks(per).enumerate() {
                let (dst, at) = if i >= prompt.len() {
                    (&mut out.response_routes, row * l + (i - prompt.len()))
                } else if !filled[slot] {
                    (&mut out.prompt_routes, slot * p + p - prompt.len() + i)
                } else {
                    continue;
                };
                for (d, &e) in dst[at * per..(at + 1) * per].iter_mut().zip(ids) {
                    *d = e as i32;
                }
            }
            filled[slot] = true;
        }
        Ok(out)
    }

    /// Each row's routes in the order [`DecoderPolicy::pack_routed`] takes them (every prompt
    /// and response position of the row), from the `[U, P, Lm, k]` and `[B, L, Lm, k]` experts
    /// a pass over `packed` used ([`PolicyOutput::chosen`]): what R2 replays.
    pub fn unpack_routes(
        &self,
        rows: &[(&[u32], &[u32])],
        packed: &PackedRows,
        prompt_routes: &[i32],
        response_routes: &[i32],
    ) -> Vec<Vec<u8>> {
        let Some([lm, k]) = self.routes_per_position() else {
            return vec![Vec::new(); rows.len()];
        };
        let per = (lm * k) as usize;
        let (p, l) = (self.prompt_len, self.response_len);
        rows.iter()
            .enumerate()
            .map(|(row, (prompt, response))| {
                let slot = self.slot_of(packed, row);
                let mut out = Vec::with_capacity((prompt.len() + response.len()) * per);
                let first = slot * p + p - prompt.len();
                for at in first..first + prompt.len() {
                    out.extend(prompt_routes[at * per..(at + 1) * per].iter().map(|&e| e as u8));
                }
                for at in row * l..row * l + response.len() {
                    out.extend(response_routes[at * per..(at + 1) * per].iter().map(|&e| e as u8));
                }
                out
            })
            .collect()
    }

    /// The prompt slot of row `row` of `packed` over the whole micro-batch (`prompt_index`
    /// counts from the start of the row's block).
    fn slot_of(&self, packed: &PackedRows, row: usize) -> usize {
        (row / self.rows_per_block().max(1)) * self.slots_per_block() + packed.prompt_index[row] as usize
    }

    /// The token arrays of [`DecoderPolicy::pack`].
    fn pack_tokens(&self, rows: &[(&[u32], &[u32])]) -> Result<PackedRows, PackError> {
        let (p, l, mb) = (self.prompt_len, self.response_len, self.micro_batch_size);
        if rows.len() > mb {
            return Err(PackError::TooManyRows {
                rows: rows.len(),
                max: mb,
            });
        }
        let (per_block, slots) = (self.rows_per_block(), self.slots_per_block());
        let (u, shared) = (self.prompt_slots(), self.shares_prompts());
        let mut out = PackedRows {
            prompts: vec![0; u * p],
            prompt_mask: vec![0; u * p],
            responses: vec![0; mb * l],
            response_mask: vec![0.0; mb * l],
            prompt_index: vec![0; mb],
            prompt_routes: Vec::new(),
            response_routes: Vec::new(),
        };
        for (block, chunk) in rows.chunks(per_block.max(1)).enumerate() {
            let first = block * per_block;
            // A slot per row (no sharing): row i of the block is slot i, equal prompts or not.
            let distinct = if shared {
                distinct_prompts(chunk)
            } else {
                chunk.iter().map(|(p, _)| *p).collect()
            };
            if distinct.len() > slots {
                return Err(PackError::TooManyPrompts {
                    first,
                    end: first + chunk.len(),
                    distinct: distinct.len(),
                    slots,
                    group: self.group_size,
                });
            }
            for (i, (prompt, response)) in chunk.iter().enumerate() {
                let row = first + i;
                if prompt.is_empty() {
                    return Err(PackError::EmptyPrompt { row });
                }
                if prompt.len() > p {
                    return Err(PackError::PromptTooLong {
                        row,
                        len: prompt.len(),
                        max: p,
                    });
                }
                if response.len() > l {
                    return Err(PackError::ResponseTooLong {
                        row,
                        len: response.len(),
                        max: l,
                    });
                }
                let slot = if shared {
                    distinct.iter().position(|s| s == prompt).expect("listed above")
                } else {
                    i
                };
                out.prompt_index[row] = slot as i32;
                for (j, &t) in response.iter().enumerate() {
                    out.responses[row * l + j] = t as i32;
                    out.response_mask[row * l + j] = 1.0;
                }
            }
            for (k, prompt) in distinct.iter().enumerate() {
                let base = (block * slots + k) * p;
                for (i, &t) in prompt.iter().enumerate() {
                    let col = p - prompt.len() + i;
                    out.prompts[base + col] = t as i32;
                    out.prompt_mask[base + col] = 1;
                }
            }
        }
        Ok(out)
    }

    /// Whether `rows` fit this policy's prompt slots (else pack them with
    /// [`DecoderPolicy::unshared`]).
    pub fn fits(&self, rows: &[(&[u32], &[u32])]) -> bool {
        let slots = self.slots_per_block();
        rows.chunks(self.rows_per_block().max(1))
            .all(|chunk| distinct_prompts(chunk).len() <= slots)
    }
}

/// The distinct prompts of `rows`, in order of first appearance.
fn distinct_prompts<'a>(rows: &[(&'a [u32], &[u32])]) -> Vec<&'a [u32]> {
    let mut out: Vec<&[u32]> = Vec::new();
    for (p, _) in rows {
        if !out.contains(p) {
            out.push(p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> DecoderPolicy {
        let config = ModelConfig::from_hf_json(
            &serde_json::json!({
                "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 16,
                "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true
            }),
            "test",
        )
        .unwrap();
        DecoderPolicy {
            config,
            prompt_len: 3,
            response_len: 2,
            micro_batch_size: 3,
            temperature: 1.0,
            group_size: 1,
            blocks: 1,
            remat: false,
            scan: false,
            lora: None,
            lora_form: model::LoraForm::default(),
            head: Default::default(),
            route_inputs: false,
            moe_lowering: Default::default(),
        }
    }

    #[test]
    fn rows_are_packed_prompt_left_response_right() {
        let p = policy();
        let packed = p.pack(&[(&[5, 6], &[7]), (&[1, 2, 3], &[4, 9])]).unwrap();
        assert_eq!(packed.prompts, vec![0, 5, 6, 1, 2, 3, 0, 0, 0]);
        assert_eq!(packed.prompt_mask, vec![0, 1, 1, 1, 1, 1, 0, 0, 0]);
        assert_eq!(packed.responses, vec![7, 0, 4, 9, 0, 0]);
        assert_eq!(packed.response_mask, vec![1.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
        assert_eq!(packed.prompt_index, vec![0, 1, 0]);
        assert_eq!(p.input_specs()[0].dims, vec![3, 3]);
    }

    #[test]
    fn groups_share_one_prompt_slot_per_block() {
        // 8 rows in groups of 4 over 2 blocks: one slot per block.
        let p = DecoderPolicy {
            micro_batch_size: 8,
            group_size: 4,
            blocks: 2,
            remat: false,
            scan: false,
            ..policy()
        };
        assert_eq!(p.prompt_slots(), 2);
        let (a, b): (&[u32], &[u32]) = (&[1, 2], &[3]);
        let rows: Vec<(&[u32], &[u32])> = (0..8).map(|r| (if r < 4 { a } else { b }, &[5u32][..])).collect();
        let packed = p.pack(&rows).unwrap();
        assert_eq!(packed.prompts, vec![0, 1, 2, 0, 0, 3]);
        assert_eq!(packed.prompt_index, vec![0; 8]);
        assert_eq!(p.input_specs()[2].dims, vec![8, 2]);
        // Groups out of order need a slot per row: the unshared policy packs them.
        let mixed: Vec<(&[u32], &[u32])> = (0..8)
            .map(|r| (if r % 2 == 0 { a } else { b }, &[5u32][..]))
            .collect();
        assert!(!p.fits(&mixed));
        let e = p.pack(&mixed).unwrap_err().to_string();
        assert!(
            e.starts_with("rows 0..4 hold 2 distinct prompts; the learner packs at most 1"),
            "{e}"
        );
        let unshared = p.unshared();
        assert!(unshared.fits(&mixed));
        assert_eq!(unshared.prompt_slots(), 8);
        // A slot per row, counted from the start of each block of 4 rows.
        assert!(!unshared.shares_prompts());
        assert_eq!(
            unshared.pack(&mixed).unwrap().prompt_index,
            vec![0, 1, 2, 3, 0, 1, 2, 3]
        );
    }

    #[test]
    fn prompt_slots_cover_any_block_of_consecutive_groups() {
        assert_eq!(prompts_in(8, 8), 1);
        assert_eq!(prompts_in(32, 8), 4);
        assert_eq!(prompts_in(4, 8), 1);
        assert_eq!(prompts_in(6, 4), 3);
        assert_eq!(prompts_in(5, 1), 5);
        assert_eq!(prompts_in(3, 2), 2);
    }

    #[test]
    fn rows_that_do_not_fit_are_named() {
        let p = policy();
        let e = p
            .pack(&[(&[1], &[2]), (&[1, 2, 3, 4], &[5])])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("row 1: the prompt has 4 tokens, more than the 3"),
            "{e}"
        );
        let e = p.pack(&[(&[1], &[2, 3, 4])]).unwrap_err().to_string();
        assert!(e.contains("response has 3 tokens"), "{e}");
        assert!(p
            .pack(&[(&[], &[2])])
            .unwrap_err()
            .to_string()
            .contains("prompt is empty"));
        let row: (&[u32], &[u32]) = (&[1], &[2]);
        let e = p.pack(&[row; 4]).unwrap_err().to_string();
        assert!(e.contains("4 rows given; a micro-batch holds 3"), "{e}");
    }
}
