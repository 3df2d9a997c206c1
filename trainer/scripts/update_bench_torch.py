"""Peer of `trainer/examples/update_bench.rs`: the same GRPO update written in plain PyTorch with
Hugging Face transformers on the CPU.

One update = forward of the model (`AutoModelForCausalLM`) over the packed rows (prompt + response, f32),
per-token log-probs of the response tokens at the sampling temperature, VeRL's PPO clipped
surrogate with dual clip (`compute_policy_loss_vanilla`) aggregated `token-mean`, backward,
`clip_grad_norm_`, `torch.optim.AdamW.step()`, `zero_grad()`; with several micro-batches the
gradients of each micro-batch (normalised by the mini-batch's token count) are accumulated
before the one optimizer step, as the learner does. The entropy of the response positions is
computed as a metric without gradient (the learner reports it too).

usage: update_bench_torch.py MODEL_DIR BATCH_JSON [--threads N] [--micro-batch M] [--dtype f32|bf16]

`--dtype bf16` runs the model's forward (and so its backward) under
`torch.autocast("cpu", dtype=torch.bfloat16)`: bf16 matmuls, f32 parameters, optimizer state and
log-softmax (the logits are cast to f32 before it), as mixed-precision training does.

BATCH_JSON (written by the Rust example) holds `tokens` [rows][P + L], `prompt_len`,
`response_len`, `old_log_probs`, `advantages`, `response_mask` ([rows][L] each), `temperature`,
`lr`, `betas`, `eps`, `weight_decay`, `grad_clip`, `clip_ratio_low`, `clip_ratio_high`,
`clip_ratio_c`. The script loads the model, then reads commands from stdin, one per line:
`step` runs one update and prints one JSON line `{"seconds": ..., "pg_loss": ..., ...}`;
`quit` (or end of input) exits. It prints `ready` once loaded, so the caller can alternate its
own steps with the peer's and both see the same machine load.
"""
import argparse
import json
import os
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("batch_json")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch intra-op threads (default: the machine's core count)")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="rows per forward/backward pass (default: all rows at once)")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                   help="compute type of the forward: f32, or bf16 autocast (f32 master weights)")
    return p.parse_args()


def policy_loss_vanilla(log_prob, old_log_prob, advantages, mask, n_tokens, cfg):
    """VeRL core_algos.compute_policy_loss_vanilla with agg_loss(token-mean), the mini-batch's
    token count as the denominator (so micro-batch losses add up to the mini-batch loss)."""
    def token_mean(x):
        return torch.where(mask != 0, x * mask, torch.zeros_like(x)).sum() / (n_tokens + 1e-8)

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = token_mean(-negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cfg["clip_ratio_low"], 1.0 + cfg["clip_ratio_high"])
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = token_mean(torch.gt(pg_losses2, pg_losses1).float())
    pg_losses3 = -advantages * cfg["clip_ratio_c"]
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = token_mean(torch.gt(clip_pg_losses1, pg_losses3).float() * (advantages < 0).float())
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return token_mean(pg_losses), pg_clipfrac, pg_clipfrac_lower, ppo_kl


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = json.load(open(args.batch_json))
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    model.train()
    model.config.use_cache = False
    optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=tuple(cfg["betas"]),
                              eps=cfg["eps"], weight_decay=cfg["weight_decay"])
    tokens = torch.tensor(cfg["tokens"], dtype=torch.long)
    rows = tokens.shape[0]
    attention_mask = torch.ones_like(tokens)
    p_len, r_len = cfg["prompt_len"], cfg["response_len"]
    old = torch.tensor(cfg["old_log_probs"], dtype=torch.float32)
    adv = torch.tensor(cfg["advantages"], dtype=torch.float32)
    resp_mask = torch.tensor(cfg["response_mask"], dtype=torch.float32)
    n_tokens = resp_mask.sum()
    mb = args.micro_batch or rows
    temperature = cfg["temperature"]

    def update():
        sums = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0, "entropy": 0.0}
        for s in range(0, rows, mb):
            sl = slice(s, s + mb)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                logits = model(input_ids=tokens[sl], attention_mask=attention_mask[sl]).logits
            logits = logits.float()
            # Position i predicts token i + 1: the response tokens are predicted by columns
            # P - 1 .. P + L - 2.
            logits = logits[:, p_len - 1:p_len + r_len - 1, :] / temperature
            logp_all = torch.log_softmax(logits, dim=-1)
            log_prob = torch.gather(logp_all, -1, tokens[sl, p_len:].unsqueeze(-1)).squeeze(-1)
            pg_loss, clipfrac, clipfrac_lower, ppo_kl = policy_loss_vanilla(
                log_prob, old[sl], adv[sl], resp_mask[sl], n_tokens, cfg)
            pg_loss.backward()
            with torch.no_grad():
                ent = -(logp_all.exp() * logp_all).sum(-1)
                m = resp_mask[sl]
                sums["entropy"] += float((ent * m).sum() / (n_tokens + 1e-8))
            sums["pg_loss"] += float(pg_loss.detach())
            sums["pg_clipfrac"] += float(clipfrac.detach())
            sums["pg_clipfrac_lower"] += float(clipfrac_lower.detach())
            sums["ppo_kl"] += float(ppo_kl.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=cfg["grad_clip"])
        optim.step()
        optim.zero_grad(set_to_none=True)
        sums["grad_norm"] = float(grad_norm)
        return sums

    print(f"peer: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.dtype}, {rows} rows x {p_len}+{r_len} tokens, "
          f"micro-batch {mb}, attention {model.config._attn_implementation}", flush=True)
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "step":
            print(json.dumps({"error": f"unknown command {command!r}; expected step or quit"}), flush=True)
            continue
        start = time.perf_counter()
        metrics = update()
        metrics["seconds"] = time.perf_counter() - start
        print(json.dumps(metrics), flush=True)


if __name__ == "__main__":
    main()
