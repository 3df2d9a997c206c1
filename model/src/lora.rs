//! LoRA adapters (Hu et al. 2021) on a decoder's linear projections, in PEFT's format.
//!
//! An adapter on a projection `W [out, in]` is a pair `A [r, in]`, `B [out, r]`, and the
//! adapted projection is `W' = W + s·B·A` with `s = alpha / r` (or `alpha / sqrt(r)` with
//! rank-stabilised LoRA, Kalajdzievski 2023). PEFT initialises `A` uniformly in
//! `±1/sqrt(in)` (Kaiming-uniform with `a = sqrt(5)`) and `B` to zero, so a fresh adapter
//! leaves the model unchanged.
//!
//! On disk an adapter is PEFT's directory: `adapter_config.json` and
//! `adapter_model.safetensors` with tensors named
//! `base_model.model.<projection>.lora_A.weight` / `lora_B.weight`, where `<projection>` is the
//! base weight's Hugging Face name without `.weight`. [`LoraAdapter::load_peft`] reads one made
//! by PEFT (refusing, by name, the PEFT options this crate does not implement),
//! [`LoraAdapter::save_peft`] writes one PEFT loads.
//!
//! The adapted weight is computed by one graph function, [`merged_weight`]; [`merge_params`]
//! applies it over a whole parameter table inside any program, and [`LoraAdapter::merge_into`]
//! runs it on a device to give the merged model's host weights (`grpo generate --adapter`).
//! [`MergeProgram`] is that merge compiled, on one device or as one SPMD program over a
//! learner's mesh ([`MergeProgram::compile_over`], [`MergeLayout`]). The other form,
//! [`LoraForm::Applied`], keeps the adapters beside the weights instead
//! ([`crate::forward::DecoderParams::with_adapters`]).
//!
//! The adapters' parameter table ([`lora_param_table`]) follows the base's Megatron split:
//! `A` splits with a row-parallel base's input, `B` with a column-parallel base's output.
//!
//! A mixture of experts' stacked experts (`mlp.experts.gate_up_proj` `[E, out, in]`, ...) are
//! parameters, not linear modules: PEFT adapts them through `target_parameters`, with one pair
//! per stacked tensor holding every expert's adapter, `A [r·E, in]` (expert `e`'s rows
//! `e·r .. e·r + r`) and `B [out, r·E]` (expert `e`'s columns `e, E + e, 2E + e, ...`), so that
//! expert `e` computes with `W[e] + s·B_e·A_e` (PEFT's `ParamWrapper`). The same layout here, so
//! an adapter moves between PEFT and grpo as it is; `A` splits by expert with its base, `B`
//! stays whole (its experts are interleaved).

use std::collections::HashMap;
use std::path::Path;

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use xla::graph::{BuildOptions, Graph, Mesh, Sharding, Tensor};
use xla::runtime::{Buffer, Client, Executable};
use xla::DType;

use crate::config::ModelConfig;
use crate::error::{runtime, ProgramError};
use crate::error::{ModelError, Result};
use crate::params::{param_table, ModelSplit, ParamKind, ParamSpec};
use crate::safetensors_io::{read_safetensors, take_by_table, write_dir_atomically, ModelWeights};
use crate::tensor::HostTensor;

/// PEFT's adapter configuration file.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// PEFT's adapter weights file.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// PEFT's prefix before a base model's own parameter names (`PeftModel.base_model.model`).
const PEFT_PREFIX: &str = "base_model.model.";

/// A projection an adapter can sit on, by the module name PEFT's `target_modules` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    /// A mixture of experts' stacked gate and up projections, `mlp.experts.gate_up_proj`.
    ExpertsGateUp,
    /// A mixture of experts' stacked down projections, `mlp.experts.down_proj`.
    ExpertsDown,
}

impl Target {
    /// Every projection, in the parameter table's order (PEFT's `all-linear` minus the head).
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The stacked expert parameters, named by PEFT's `target_parameters`.
    pub const EXPERTS: [Target; 2] = [Target::ExpertsGateUp, Target::ExpertsDown];

    /// Whether this target is a stacked expert parameter (`target_parameters`) rather than a
    /// linear module (`target_modules`).
    pub fn is_experts(self) -> bool {
        Target::EXPERTS.contains(&self)
    }

    /// The module name (`q_proj`, ..., `down_proj`), or for the experts the parameter's name
    /// as `target_parameters` lists it (`mlp.experts.gate_up_proj`).
    pub fn module(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
            Target::ExpertsGateUp => "mlp.experts.gate_up_proj",
            Target::ExpertsDown => "mlp.experts.down_proj",
        }
    }

    /// The base weight of this projection in layer `layer`.
    pub fn weight_name(self, layer: usize) -> String {
        if self.is_experts() {
            return format!("model.layers.{layer}.{}", self.module());
        }
        let block = if matches!(self, Target::Gate | Target::Up | Target::Down) {
            "mlp"
        } else {
            "self_attn"
        };
        format!("model.layers.{layer}.{block}.{}.weight", self.module())
    }

    /// Parses a module name: PEFT's (`q_proj`), its short form (`q`), or a module path ending
    /// in one (`model.layers.0.self_attn.q_proj`, as PEFT saves `all-linear`).
    pub fn parse(name: &str) -> Option<Target> {
        let last = name.rsplit('.').next().unwrap_or(name);
        let short = last.strip_suffix("_proj").unwrap_or(last);
        Target::ALL
            .into_iter()
            .find(|t| t.module().strip_suffix("_proj") == Some(short))
    }

    /// Parses PEFT's `target_parameters`: a list of parameter names, each the stacked experts'
    /// `mlp.experts.gate_up_proj` or `mlp.experts.down_proj`, a path ending in one, or (as PEFT
    /// matches names by their end) a tail of one: `down_proj`, `experts.down_proj`. PEFT itself
    /// saves `target_modules`' `down_proj` among them when both name it.
    pub fn parse_parameters(names: &[String]) -> std::result::Result<Vec<Target>, String> {
        let found = names.iter().map(|name| {
            Target::EXPERTS
                .into_iter()
                .find(|t| {
                    let full = t.module();
                    name == full || full.ends_with(&format!(".{name}")) || name.ends_with(&format!(".{full}"))
                })
                .ok_or_else(|| {
                    format!(
                        "`{name}` is not a parameter LoRA can adapt here; the stacked experts are {}",
                        Target::EXPERTS.map(Target::module).join(" and ")
                    )
                })
        });
        sorted_once(found)
    }

    /// Parses PEFT's `target_modules`: `all-linear`, or a list of module names (possibly
    /// empty, when `target_parameters` names what to adapt). An error says which name is not a
    /// projection this crate adapts.
    pub fn parse_list(names: &[String]) -> std::result::Result<Vec<Target>, String> {
        if names.len() == 1 && names[0] == "all-linear" {
            return Ok(Target::ALL.to_vec());
        }
        sorted_once(names.iter().map(|name| {
            Target::parse(name).ok_or_else(|| {
                format!(
                    "`{name}` is not a projection LoRA can adapt here; use `all-linear` or names from {}",
                    Target::ALL.map(Target::module).join(", ")
                )
            })
        }))
    }
}

/// The parsed targets in [`Target`]'s order, each once; the first error if a name parses as none.
fn sorted_once(
    targets: impl Iterator<Item = std::result::Result<Target, String>>,
) -> std::result::Result<Vec<Target>, String> {
    let mut out = targets.collect::<std::result::Result<Vec<_>, _>>()?;
    out.sort();
    out.dedup();
    Ok(out)
}

/// How a model computes with its LoRA adapters: on the merged weights `W + s·B·A` (a copy of
/// every adapted weight, made once per adapter version) or with the adapters applied beside the
/// frozen weights, `x·Wᵀ + s·(x·Aᵀ)·Bᵀ` in every pass ([`crate::forward::DecoderParams::with_adapters`]).
/// The same function; the learner and the rollout of a run use the same form, so their
/// log-probabilities stay the same quantity in bf16 too.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraForm {
    #[default]
    Merged,
    Applied,
}

/// PEFT's `target_modules` as a recipe writes it: `all-linear` or a list of module names
/// (`q_proj` or `q`, ...), parsed by [`Target::parse_list`]; serialised as the list of
/// PEFT's module names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetModules(pub Vec<Target>);

impl Default for TargetModules {
    fn default() -> Self {
        TargetModules(Target::ALL.to_vec())
    }
}

impl serde::Serialize for TargetModules {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|t| t.module()))
    }
}

impl<'de> serde::Deserialize<'de> for TargetModules {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        let names = match OneOrMany::deserialize(d)? {
            OneOrMany::One(name) => vec![name],
            OneOrMany::Many(names) => names,
        };
        Target::parse_list(&names)
            .map(TargetModules)
            .map_err(serde::de::Error::custom)
    }
}

/// PEFT's `target_parameters` as a recipe writes it (`[mlp.experts.gate_up_proj,
/// mlp.experts.down_proj]`), parsed by [`Target::parse_parameters`]; none by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TargetParameters(pub Vec<Target>);

impl serde::Serialize for TargetParameters {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|t| t.module()))
    }
}

impl<'de> serde::Deserialize<'de> for TargetParameters {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let names = Vec::<String>::deserialize(d)?;
        Target::parse_parameters(&names)
            .map(TargetParameters)
            .map_err(serde::de::Error::custom)
    }
}

/// The shape of a model's adapters: rank, scale and which projections carry them.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// `r`, the rank of `B·A`.
    pub rank: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// The adapted projections and stacked experts, in [`Target`]'s order, on every layer.
    pub targets: Vec<Target>,
    /// Rank-stabilised scaling `alpha / sqrt(r)` instead of `alpha / r` (PEFT's `use_rslora`).
    pub use_rslora: bool,
}

impl LoraConfig {
    /// PEFT's `adapter_config.json` for these adapters on the model `base_model`.
    pub fn to_peft_json(&self, base_model: &str) -> Value {
        let modules: Vec<&str> = self
            .targets
            .iter()
            .filter(|t| !t.is_experts())
            .map(|t| t.module())
            .collect();
        let parameters: Vec<&str> = self
            .targets
            .iter()
            .filter(|t| t.is_experts())
            .map(|t| t.module())
            .collect();
        json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "use_rslora": self.use_rslora,
            "target_modules": if modules.is_empty() { Value::Null } else { json!(modules) },
            "target_parameters": if parameters.is_empty() { Value::Null } else { json!(parameters) },
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": false,
            "use_dora": false,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "init_lora_weights": true,
            "inference_mode": true,
        })
    }

    /// The adapters PEFT's `adapter_config.json` describes, or what in it this crate cannot
    /// honour (PEFT options that change the forward pass are refused by name).
    pub fn from_peft_json(json: &Value) -> std::result::Result<LoraConfig, String> {
        let get = |key: &str| json.get(key).unwrap_or(&Value::Null);
        match get("peft_type").as_str() {
            Some("LORA") => {}
            other => {
                return Err(format!(
                    "`peft_type` is {}; only LORA adapters load here",
                    other.map_or("missing".to_string(), |s| format!("`{s}`"))
                ))
            }
        }
        for (key, off) in UNSUPPORTED_PEFT_OPTIONS {
            if !is_off(get(key)) {
                return Err(format!(
                    "`{key}` is {}; this adapter needs a PEFT feature grpo does not implement (it loads adapters with `{key}: {off}`)",
                    get(key)
                ));
            }
        }
        if let Some(bias) = get("bias").as_str().filter(|b| *b != "none") {
            return Err(format!(
                "`bias` is `{bias}`: the adapter trains biases, which grpo does not implement (it loads adapters with `bias: none`)"
            ));
        }
        let rank = get("r")
            .as_u64()
            .filter(|r| *r > 0)
            .ok_or("`r` must be a positive integer")? as usize;
        let alpha = get("lora_alpha")
            .as_f64()
            .ok_or("`lora_alpha` must be a number")?;
        let strings = |key: &str| -> std::result::Result<Vec<String>, String> {
            match get(key) {
                Value::Null => Ok(Vec::new()),
                Value::Array(items) => items
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_string)
                            .ok_or(format!("`{key}` must hold strings"))
                    })
                    .collect(),
                _ => Err(format!("`{key}` must be a list of names")),
            }
        };
        let names: Vec<String> = match get("target_modules") {
            Value::Null => Vec::new(),
            Value::String(s) if s == "all-linear" => vec![s.clone()],
            Value::String(s) => {
                return Err(format!(
                    "`target_modules` is the pattern `{s}`; grpo reads a list of module names or `all-linear`"
                ))
            }
            _ => strings("target_modules")?,
        };
        let mut targets = Target::parse_list(&names).map_err(|e| format!("`target_modules`: {e}"))?;
        targets.extend(
            Target::parse_parameters(&strings("target_parameters")?)
                .map_err(|e| format!("`target_parameters`: {e}"))?,
        );
        if targets.is_empty() {
            return Err("neither `target_modules` nor `target_parameters` names what to adapt".into());
        }
        Ok(LoraConfig {
            rank,
            alpha,
            targets,
            use_rslora: get("use_rslora").as_bool().unwrap_or(false),
        })
    }

    /// `s`, the factor of `B·A`.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }
}

/// One adapted projection: its base weight and the adapter's two matrices.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// The decoder layer.
    pub layer: usize,
    /// The adapted projection.
    pub target: Target,
    /// The base weight's Hugging Face name (`model.layers.0.self_attn.q_proj.weight`).
    pub base: String,
    /// `A [r, in]`, named as PEFT saves it. Under tensor parallelism it splits with the base's
    /// input dimension (row-parallel projections), else it is whole.
    pub a: ParamSpec,
    /// `B [out, r]`, named as PEFT saves it; it splits with the base's output dimension
    /// (column-parallel projections), else it is whole.
    pub b: ParamSpec,
}

/// PEFT's name of `matrix` (`lora_A`, `lora_B`) of the adapter on the base tensor `base`.
fn peft_name(base: &str, matrix: &str) -> String {
    let module = base.strip_suffix(".weight").unwrap_or(base);
    format!("{PEFT_PREFIX}{module}.{matrix}.weight")
}

/// PEFT's name of `matrix` of the adapter on a layer's stacked experts `target`. PEFT wraps the
/// experts module once per targeted parameter, in the module's own order (`gate_up_proj`, then
/// `down_proj`), each wrapper around the one before, whose module is its `base_layer`: with both
/// targeted, `gate_up_proj`'s adapter is `experts.base_layer.lora_A` and `down_proj`'s
/// `experts.lora_A` (checked against PEFT 0.22.0).
fn peft_expert_name(layer: usize, target: Target, targets: &[Target], matrix: &str) -> String {
    let experts: Vec<Target> = targets.iter().copied().filter(|t| t.is_experts()).collect();
    let depth = experts.len() - 1 - experts.iter().position(|&t| t == target).expect("a target");
    format!(
        "{PEFT_PREFIX}model.layers.{layer}.mlp.experts.{}{matrix}.weight",
        "base_layer.".repeat(depth)
    )
}

/// The adapters of `config` under `lora`, layer by layer, each layer's in [`Target`] order. As
/// in PEFT, a target names modules or parameters: a layer without one is not adapted (the MLP
/// targets skip mixture-of-experts layers, whose experts are stacked parameters, not linear
/// modules, in transformers 5; the expert targets skip dense layers).
pub fn lora_table(config: &ModelConfig, lora: &LoraConfig) -> Vec<LoraSpec> {
    let base: HashMap<String, ParamSpec> = param_table(config)
        .into_iter()
        .map(|p| (p.name.clone(), p))
        .collect();
    let mut out = Vec::new();
    for layer in 0..config.num_hidden_layers {
        for &t in &lora.targets {
            let name = t.weight_name(layer);
            let Some(w) = base.get(&name) else {
                continue;
            };
            let (a, b) = if t.is_experts() {
                // `[E, out, in]`: A's rows are expert-major and split by expert with the base;
                // B's columns interleave the experts, so B stays whole.
                let (e, o, i) = (w.shape[0], w.shape[1], w.shape[2]);
                let name = |m| peft_expert_name(layer, t, &lora.targets, m);
                let mut a = ParamSpec::new(name("lora_A"), vec![lora.rank * e, i], ParamKind::Matrix);
                if let Some(ModelSplit { dim: 0, .. }) = w.model_split {
                    a = a.split_by_model(0, lora.rank);
                }
                (
                    a,
                    ParamSpec::new(name("lora_B"), vec![o, lora.rank * e], ParamKind::Matrix),
                )
            } else {
                let (o, i) = (w.shape[0], w.shape[1]);
                let mut a = ParamSpec::new(peft_name(&name, "lora_A"), vec![lora.rank, i], ParamKind::Matrix);
                let mut b = ParamSpec::new(peft_name(&name, "lora_B"), vec![o, lora.rank], ParamKind::Matrix);
                match w.model_split {
                    Some(ModelSplit { dim: 0, unit }) => b = b.split_by_model(0, unit),
                    Some(ModelSplit { dim: 1, unit }) => a = a.split_by_model(1, unit),
                    _ => {}
                }
                (a, b)
            };
            out.push(LoraSpec {
                layer,
                target: t,
                base: name,
                a,
                b,
            });
        }
    }
    out
}

/// The adapters' parameters in program order: `A`, `B` of each [`lora_table`] entry.
pub fn lora_param_table(config: &ModelConfig, lora: &LoraConfig) -> Vec<ParamSpec> {
    lora_table(config, lora)
        .into_iter()
        .flat_map(|s| [s.a, s.b])
        .collect()
}

/// `W + s·B·A`, computed in f32 (f64 for an f64 `w`) and returned in `w`'s element type: the
/// adapted projection. For stacked experts `W [E, out, in]` (`A [r·E, in]`, `B [out, r·E]`,
/// PEFT's layout) expert `e`'s `W[e] + s·B_e·A_e`.
pub fn merged_weight(w: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Tensor {
    let wide = if w.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let (a, b) = match w.dims() {
        &[e, out, inner] => {
            let r = a.dims()[0] / e;
            (
                a.reshape(&[e, r, inner]),
                b.reshape(&[out, r, e]).transpose(&[2, 0, 1]),
            )
        }
        _ => (a.clone(), b.clone()),
    };
    let delta = b.convert_if_needed(wide).matmul(&a.convert_if_needed(wide));
    let delta = &delta * &delta.scalar_like(scale);
    (&w.convert_if_needed(wide) + &delta).convert_if_needed(w.dtype())
}

/// The parameter table (`base`, in [`param_table`] order) with each adapted projection replaced
/// by [`merged_weight`] (`adapters` in [`lora_param_table`] order). Inside a differentiable
/// program the gradient reaches `A` and `B` through the merge.
pub fn merge_params(
    config: &ModelConfig,
    lora: &LoraConfig,
    base: &[Tensor],
    adapters: &[Tensor],
) -> Vec<Tensor> {
    let names: HashMap<String, usize> = param_table(config)
        .into_iter()
        .enumerate()
        .map(|(i, p)| (p.name, i))
        .collect();
    let mut out = base.to_vec();
    for (k, spec) in lora_table(config, lora).iter().enumerate() {
        let i = names[&spec.base];
        out[i] = merged_weight(&base[i], &adapters[2 * k], &adapters[2 * k + 1], lora.scale());
    }
    out
}

/// `lora` and its `adapters` (in [`lora_param_table`] order) in two: the projections' and the
/// stacked experts'. A learner merges the first into its weights and hands the second to each
/// layer ([`crate::forward::DecoderParams::with_adapters`]), which merges them where it computes:
/// a scanned or rematerialised model then holds one layer's merged experts at a time, not all.
pub fn split_experts(
    config: &ModelConfig,
    lora: &LoraConfig,
    adapters: &[Tensor],
) -> ((LoraConfig, Vec<Tensor>), (LoraConfig, Vec<Tensor>)) {
    let part = |experts: bool| {
        let sub = LoraConfig {
            targets: lora
                .targets
                .iter()
                .copied()
                .filter(|t| t.is_experts() == experts)
                .collect(),
            ..lora.clone()
        };
        let tensors = lora_table(config, lora)
            .iter()
            .zip(adapters.chunks_exact(2))
            .filter(|(spec, _)| spec.target.is_experts() == experts)
            .flat_map(|(_, pair)| pair.iter().cloned())
            .collect();
        (sub, tensors)
    };
    (part(false), part(true))
}

/// A model's adapters on the host: their configuration and `A`, `B` of each adapted
/// projection, in [`lora_param_table`] order, in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraAdapter {
    pub lora: LoraConfig,
    pub tensors: Vec<HostTensor>,
}

/// The PEFT options this crate does not implement, with the value that means "off".
const UNSUPPORTED_PEFT_OPTIONS: [(&str, &str); 12] = [
    ("use_dora", "false"),
    ("use_qalora", "false"),
    ("use_bdlora", "null"),
    ("alora_invocation_tokens", "null"),
    ("trainable_token_indices", "null"),
    ("fan_in_fan_out", "false"),
    ("modules_to_save", "null"),
    ("layers_to_transform", "null"),
    ("rank_pattern", "{}"),
    ("alpha_pattern", "{}"),
    ("lora_bias", "false"),
    ("layer_replication", "null"),
];

fn is_off(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

impl LoraAdapter {
    /// A fresh adapter as PEFT initialises one: `A` uniform in `±1/sqrt(in)`, `B` zero. The
    /// same seed gives the same adapter.
    pub fn init(config: &ModelConfig, lora: &LoraConfig, seed: u64) -> LoraAdapter {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut tensors = Vec::new();
        for spec in lora_table(config, lora) {
            let bound = 1.0 / (spec.a.shape[1] as f64).sqrt();
            let a: Vec<f32> = (0..spec.a.numel())
                .map(|_| (rng.random_range(-bound..bound)) as f32)
                .collect();
            tensors.push(HostTensor::from_f32(spec.a.name, spec.a.shape, &a));
            let zeros = vec![0.0; spec.b.numel()];
            tensors.push(HostTensor::from_f32(spec.b.name, spec.b.shape, &zeros));
        }
        LoraAdapter {
            lora: lora.clone(),
            tensors,
        }
    }

    /// Reads PEFT's adapter directory `dir` for a base model of `config`. Every tensor must be
    /// there with its shape and nothing else may be: a missing, extra or misshapen tensor is
    /// named (an adapter made for another base model shows up this way).
    pub fn load_peft(dir: &Path, config: &ModelConfig) -> Result<LoraAdapter> {
        let config_path = dir.join(ADAPTER_CONFIG_FILE);
        let text =
            std::fs::read_to_string(&config_path).map_err(|e| ModelError::io("reading", &config_path, e))?;
        let json: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: config_path.clone(),
            source,
        })?;
        let lora = LoraConfig::from_peft_json(&json).map_err(|problem| ModelError::Adapter {
            path: config_path.clone(),
            problem,
        })?;
        let weights_path = dir.join(ADAPTER_WEIGHTS_FILE);
        if !weights_path.exists() && dir.join("adapter_model.bin").exists() {
            return Err(ModelError::Adapter {
                path: dir.to_path_buf(),
                problem: "holds adapter_model.bin (a pickle); save the adapter with PEFT's \
                          `save_pretrained(..., safe_serialization=True)` to get adapter_model.safetensors"
                    .into(),
            });
        }
        let mut found = read_safetensors(&weights_path)?;
        let origin = weights_path.display().to_string();
        let tensors: Vec<HostTensor> = take_by_table(&mut found, &lora_param_table(config, &lora), &origin)?
            .into_iter()
            .map(|t| t.to_dtype(DType::F32))
            .collect();
        if let Some((name, t)) = found.into_iter().min_by(|a, b| a.0.cmp(&b.0)) {
            return Err(ModelError::UnexpectedTensor {
                name,
                found: t.shape,
                origin,
                family: format!(
                    "{} LoRA (targets {}, rank {})",
                    config.family,
                    lora.targets
                        .iter()
                        .map(|t| t.module())
                        .collect::<Vec<_>>()
                        .join(", "),
                    lora.rank
                ),
            });
        }
        Ok(LoraAdapter { lora, tensors })
    }

    /// Writes the adapter as PEFT's directory `dir` (atomically: a reader sees the old
    /// directory or the whole new one). `base_model` is recorded as
    /// `base_model_name_or_path`.
    pub fn save_peft(&self, dir: &Path, base_model: &str) -> Result<()> {
        let config = self.lora.to_peft_json(base_model);
        write_dir_atomically(dir, |staging| {
            let path = staging.join(ADAPTER_CONFIG_FILE);
            let text = serde_json::to_string_pretty(&config).expect("JSON values serialise");
            std::fs::write(&path, text + "\n").map_err(|e| ModelError::io("writing", &path, e))?;
            crate::safetensors_io::write_safetensors(&staging.join(ADAPTER_WEIGHTS_FILE), &self.tensors)
        })
    }

    /// The merged model: `base`'s weights with each adapted projection replaced by
    /// `W + s·B·A`, computed by [`MergeProgram`] on `device` of `client` in f32 and returned in
    /// each weight's own element type.
    pub fn merge_into(
        &self,
        client: &Client,
        device: usize,
        base: &ModelWeights,
    ) -> std::result::Result<ModelWeights, ProgramError> {
        let program = MergeProgram::compile(client, &base.config, &self.lora, DType::F32)?;
        let upload = |t: &HostTensor| {
            let dims: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
            client
                .buffer_from_host(&t.to_f32_vec(), &dims, device)
                .map_err(runtime(format!("uploading `{}`", t.name)))
        };
        let adapters = self
            .tensors
            .iter()
            .map(upload)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let weights = base
            .tensors
            .iter()
            .map(upload)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let merged = program.run(&adapters, &weights)?;
        let mut out = base.clone();
        for (slot, buffer) in out.tensors.iter_mut().zip(merged) {
            let values = buffer
                .to_host::<f32>()
                .map_err(runtime("downloading lora_merge"))?;
            *slot = HostTensor::from_f32_as(slot.name.clone(), slot.shape.clone(), &values, slot.dtype);
        }
        Ok(out)
    }
}

/// The compiled merge: the adapters (f32, in [`lora_param_table`] order) and the base
/// weights (in [`param_table`] order, of one element type) in, the whole merged table out in
/// the base's type, every projection without an adapter passed through. A rollout engine
/// samples from its result after each update of a LoRA learner.
pub struct MergeProgram {
    exe: Executable,
    adapters: usize,
    weights: usize,
}

/// How [`MergeProgram::compile_over`] lays the merge out over a mesh: each adapter and base
/// tensor split as the learner holds it (`None`: replicated); the merged weights come out split
/// as the base.
#[derive(Clone, Debug)]
pub struct MergeLayout {
    pub mesh: Mesh,
    /// One per adapter tensor ([`lora_param_table`] order).
    pub adapters: Vec<Option<Sharding>>,
    /// One per base tensor ([`param_table`] order).
    pub base: Vec<Option<Sharding>>,
}

impl MergeProgram {
    /// Traces and compiles the merge for a model of `config` with weights of `dtype`, on one
    /// device.
    pub fn compile(
        client: &Client,
        config: &ModelConfig,
        lora: &LoraConfig,
        dtype: DType,
    ) -> std::result::Result<MergeProgram, ProgramError> {
        MergeProgram::compile_over(client, config, lora, dtype, None)
    }

    /// [`MergeProgram::compile`] as one SPMD program over `layout`'s mesh when given: every
    /// device merges its own shards, with the collectives XLA adds where a product needs them;
    /// no tensor is gathered whole onto one device.
    pub fn compile_over(
        client: &Client,
        config: &ModelConfig,
        lora: &LoraConfig,
        dtype: DType,
        layout: Option<&MergeLayout>,
    ) -> std::result::Result<MergeProgram, ProgramError> {
        let g = Graph::new("lora_merge");
        if let Some(l) = layout {
            g.set_mesh(l.mesh.clone());
        }
        let declare =
            |name: &str, dtype: DType, dims: &[i64], sharding: Option<&Option<Sharding>>| match sharding
                .cloned()
                .flatten()
            {
                Some(s) => g.parameter_sharded(name, dtype, dims, s),
                None => g.parameter(name, dtype, dims),
            };
        let adapters: Vec<Tensor> = lora_param_table(config, lora)
            .iter()
            .enumerate()
            .map(|(i, s)| {
                declare(
                    &s.name,
                    DType::F32,
                    &s.dims(),
                    layout.and_then(|l| l.adapters.get(i)),
                )
            })
            .collect();
        let base: Vec<Tensor> = param_table(config)
            .iter()
            .enumerate()
            .map(|(i, s)| declare(&s.name, dtype, &s.dims(), layout.and_then(|l| l.base.get(i))))
            .collect();
        let merged = merge_params(config, lora, &base, &adapters);
        let refs: Vec<&Tensor> = merged.iter().collect();
        let result_shardings = layout
            .map(|l| {
                l.base
                    .iter()
                    .enumerate()
                    .filter_map(|(i, s)| s.clone().map(|s| (i, s)))
                    .collect()
            })
            .unwrap_or_default();
        let options = BuildOptions {
            donate: Vec::new(),
            result_shardings,
        };
        let program = g
            .build_with(&refs, &options)
            .map_err(|source| ProgramError::Graph {
                program: "lora_merge".into(),
                source,
            })?;
        Ok(MergeProgram {
            exe: program.compile(client).map_err(runtime("compiling lora_merge"))?,
            adapters: adapters.len(),
            weights: base.len(),
        })
    }

    /// The merged table on the device the arguments are on.
    pub fn run(
        &self,
        adapters: &[Buffer],
        base: &[Buffer],
    ) -> std::result::Result<Vec<Buffer>, ProgramError> {
        self.check(adapters.len(), base.len())?;
        let args: Vec<&Buffer> = adapters.iter().chain(base).collect();
        self.exe.execute(&args).map_err(runtime("running lora_merge"))
    }

    /// The merged table of a program compiled over a mesh: `adapters[d]` and `base[d]` are
    /// device d's shards; returns `merged[d]`, split as the base.
    pub fn run_spmd(
        &self,
        adapters: &[&[Buffer]],
        base: &[&[Buffer]],
    ) -> std::result::Result<Vec<Vec<Buffer>>, ProgramError> {
        for (a, b) in adapters.iter().zip(base) {
            self.check(a.len(), b.len())?;
        }
        let args: Vec<Vec<&Buffer>> = adapters
            .iter()
            .zip(base)
            .map(|(a, b)| a.iter().chain(b.iter()).collect())
            .collect();
        self.exe
            .execute_spmd(&args)
            .map_err(runtime("running lora_merge"))
    }

    fn check(&self, adapters: usize, base: usize) -> std::result::Result<(), ProgramError> {
        if adapters != self.adapters || base != self.weights {
            return Err(ProgramError::Input {
                program: "lora_merge".into(),
                problem: format!(
                    "takes {} adapter and {} base tensors, given {adapters} and {base}",
                    self.adapters, self.weights,
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::tests_support::tiny_config;

    fn lora(targets: &[Target]) -> LoraConfig {
        LoraConfig {
            rank: 4,
            alpha: 8.0,
            targets: targets.to_vec(),
            use_rslora: false,
        }
    }

    #[test]
    fn expert_parameters_parse_as_peft_matches_them() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            Target::parse_parameters(&names(&[
                "mlp.experts.gate_up_proj",
                "down_proj",
                "mlp.experts.down_proj"
            ])),
            Ok(Target::EXPERTS.to_vec())
        );
        assert_eq!(
            Target::parse_parameters(&names(&["model.layers.0.mlp.experts.down_proj"])),
            Ok(vec![Target::ExpertsDown])
        );
        let e = Target::parse_parameters(&names(&["mlp.gate.weight"])).unwrap_err();
        assert!(
            e.contains("`mlp.gate.weight`") && e.contains("mlp.experts.gate_up_proj"),
            "{e}"
        );
        assert_eq!(
            Target::ExpertsGateUp.weight_name(2),
            "model.layers.2.mlp.experts.gate_up_proj"
        );
    }

    #[test]
    fn targets_parse_as_peft_names_them() {
        assert_eq!(Target::parse_list(&["all-linear".into()]).unwrap(), Target::ALL);
        assert_eq!(
            Target::parse_list(&["v_proj".into(), "q".into(), "q_proj".into()]).unwrap(),
            vec![Target::Q, Target::V]
        );
        let e = Target::parse_list(&["lm_head".into()]).unwrap_err();
        assert!(
            e.starts_with("`lm_head` is not a projection LoRA can adapt here"),
            "{e}"
        );
        assert_eq!(Target::Down.weight_name(3), "model.layers.3.mlp.down_proj.weight");
    }

    #[test]
    fn the_table_follows_peft_names_shapes_and_the_base_split() {
        let c = tiny_config();
        let t = lora_table(&c, &lora(&[Target::Q, Target::O]));
        assert_eq!(t.len(), 2 * c.num_hidden_layers);
        assert_eq!(
            t[0].a.name,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        );
        assert_eq!(t[0].a.shape, vec![4, c.hidden_size]);
        assert_eq!(t[0].b.shape, vec![c.num_attention_heads * c.head_dim, 4]);
        // Column-parallel q: B splits with its output; row-parallel o: A with its input.
        assert_eq!(t[0].b.model_split.map(|s| s.dim), Some(0));
        assert_eq!(t[0].a.model_split, None);
        assert_eq!(t[1].a.model_split.map(|s| s.dim), Some(1));
        assert_eq!(t[1].b.model_split, None);
        let rs = LoraConfig {
            use_rslora: true,
            ..lora(&[Target::Q])
        };
        assert_eq!((lora(&[Target::Q]).scale(), rs.scale()), (2.0, 4.0));
    }

    #[test]
    fn a_fresh_adapter_is_peft_init() {
        let c = tiny_config();
        let a = LoraAdapter::init(&c, &lora(&[Target::Up]), 7);
        let bound = 1.0 / (c.hidden_size as f32).sqrt();
        let a0 = a.tensors[0].to_f32_vec();
        assert!(a0.iter().all(|v| v.abs() <= bound) && a0.iter().any(|v| v.abs() > bound / 2.0));
        assert!(a.tensors[1].to_f32_vec().iter().all(|&v| v == 0.0));
        assert_eq!(a, LoraAdapter::init(&c, &lora(&[Target::Up]), 7));
    }

    #[test]
    fn unsupported_peft_options_are_named() {
        let base = json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]});
        assert_eq!(
            LoraConfig::from_peft_json(&base).unwrap().targets,
            vec![Target::Q]
        );
        let with = |key: &str, v: Value| {
            let mut j = base.clone();
            j[key] = v;
            LoraConfig::from_peft_json(&j).unwrap_err()
        };
        assert!(with("use_dora", json!(true)).starts_with("`use_dora` is true"));
        assert!(with("rank_pattern", json!({"q_proj": 4})).starts_with("`rank_pattern`"));
        assert!(with("bias", json!("all")).starts_with("`bias` is `all`"));
        assert!(with("peft_type", json!("IA3")).contains("only LORA"));
        assert!(with("target_modules", json!(".*q_proj")).contains("pattern"));
        assert!(with("r", json!(0)).contains("`r` must be a positive integer"));
        assert!(with("modules_to_save", json!(["lm_head"])).starts_with("`modules_to_save`"));
    }
}
