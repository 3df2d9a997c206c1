//! Composites built from primitives (their gradients come from the primitives' VJP rules):
//! softmax, log_softmax, logsumexp, RMSNorm, SiLU, GELU (tanh), RoPE, cross-entropy / token log-probs and
//! entropy. All reductions are numerically stabilised by subtracting the (gradient-stopped)
//! maximum.

use crate::graph::builder::Tensor;

impl Tensor {
    /// `log(sum(exp(x)))` along `axis`, stable for large inputs; keeps `axis` as size 1 when
    /// `keep`.
    #[track_caller]
    pub fn logsumexp(&self, axis: i64, keep: bool) -> Tensor {
        let m = self.stop_gradient().max_axis(axis, true);
        let s = (self - &m).exp().sum_axis(axis, true).log();
        let r = &s + &m;
        if keep {
            r
        } else {
            let a = self.axis("logsumexp", axis);
            let mut d = self.dims().to_vec();
            d.remove(a);
            r.reshape(&d)
        }
    }

    /// `exp(x) / sum(exp(x))` along `axis`.
    #[track_caller]
    pub fn softmax(&self, axis: i64) -> Tensor {
        let m = self.stop_gradient().max_axis(axis, true);
        let e = (self - &m).exp();
        &e / &e.sum_axis(axis, true)
    }

    /// `x - logsumexp(x)` along `axis`.
    #[track_caller]
    pub fn log_softmax(&self, axis: i64) -> Tensor {
        let m = self.stop_gradient().max_axis(axis, true);
        let s = self - &m;
        &s - &s.exp().sum_axis(axis, true).log()
    }

    /// `x * logistic(x)` (a.k.a. swish).
    #[track_caller]
    pub fn silu(&self) -> Tensor {
        self * &self.logistic()
    }

    /// `x · wᵀ` for a weight in Hugging Face's `[out, in]` layout: `[..., in] -> [..., out]`, the
    /// result in f32. A narrow (bf16/f16) weight takes `x` converted to its type as the other
    /// operand, with f32 accumulation and result.
    #[track_caller]
    pub fn linear(&self, w: &Tensor) -> Tensor {
        use crate::{graph::DotDims, DType};
        let dims = DotDims {
            lhs_contract: vec![self.rank() - 1],
            rhs_contract: vec![1],
            ..Default::default()
        };
        if w.dtype() == DType::F32 {
            self.convert_if_needed(DType::F32).dot_general(w, dims, None)
        } else {
            self.convert_if_needed(w.dtype())
                .dot_general(w, dims, Some(DType::F32))
        }
    }

    /// GELU with the tanh approximation (PyTorch's `gelu(approximate="tanh")`):
    /// `x/2 · (1 + tanh(sqrt(2/π) · (x + 0.044715 x³)))`.
    #[track_caller]
    pub fn gelu_tanh(&self) -> Tensor {
        let cube = &(self * self) * self;
        let inner = (self + &(cube * 0.044715)) * (2.0 / std::f64::consts::PI).sqrt();
        &(self * 0.5) * &(inner.tanh() + 1.0)
    }

    /// RMSNorm over the last axis: `x / sqrt(mean(x^2) + eps) * weight` (`weight` broadcasts
    /// against the last axis). Computed in `x`'s type: convert bf16 activations to f32 first.
    #[track_caller]
    pub fn rms_norm(&self, weight: &Tensor, eps: f64) -> Tensor {
        let ms = (self * self).mean_axis(-1, true);
        &(self * &(&ms + eps).rsqrt()) * weight
    }

    /// Rotary position embedding in the "rotate half" layout of Hugging Face Llama/Qwen:
    /// `x * cos + rotate_half(x) * sin`, where `rotate_half([a, b]) = [-b, a]` over the last
    /// axis (the head dimension, even). `cos`/`sin` broadcast against `x`
    /// (e.g. `[seq, head_dim]` for `x` of shape `[batch, heads, seq, head_dim]`).
    #[track_caller]
    pub fn rope(&self, cos: &Tensor, sin: &Tensor) -> Tensor {
        let last = self.rank().saturating_sub(1);
        let d = self.dim(-1);
        let half = d / 2;
        let x1 = self.slice_axis(last, 0, half);
        let x2 = self.slice_axis(last, half, d);
        let rotated = Tensor::concat(&[&x2.neg(), &x1], last);
        &(self * cos) + &(&rotated * sin)
    }

    /// `log softmax(logits)[target]` for each position: logits `[..., vocab]`, integer
    /// targets `[...]`; result `[...]`. Gathers the target logit and subtracts the
    /// log-sum-exp, so no full log-softmax tensor is kept for the backward pass.
    #[track_caller]
    pub fn token_log_probs(&self, targets: &Tensor) -> Tensor {
        let picked = self.take_along_last_axis(&targets.keep_axis(targets.rank()));
        let picked = picked.reshape(targets.dims());
        &picked - &self.logsumexp(-1, false)
    }

    /// Per-position cross-entropy `-log softmax(logits)[target]`.
    #[track_caller]
    pub fn cross_entropy(&self, targets: &Tensor) -> Tensor {
        self.token_log_probs(targets).neg()
    }

    /// Entropy of `softmax(logits)` over the last axis: `-sum(p * log p)`.
    #[track_caller]
    pub fn entropy(&self) -> Tensor {
        let lp = self.log_softmax(-1);
        (&lp.exp() * &lp).sum_axis(-1, false).neg()
    }
}
