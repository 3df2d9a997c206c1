"""Peer of `grpo run` for the training-run benchmark: the quickstart's GRPO run written with
TRL's `GRPOTrainer` (PyTorch, CPU), the way a TRL user would write it.

Same model (SmolLM2-135M-Instruct from the same Q4_1 GGUF, dequantised to f32 by transformers;
`--bf16` for bf16 autocast as the quickstart's bf16 compute),
same Parquet prompts (VeRL schema; TRL reads the `prompt` messages and applies the model's chat
template), same group size, batch, lengths, sampling temperature, learning rate and loss
aggregation as `recipes/quickstart.yaml`:

| quickstart.yaml                           | GRPOConfig                                      |
|-------------------------------------------|-------------------------------------------------|
| data.train_batch_size 4, rollout.n 8      | num_generations 8, 32 completions per step      |
| actor.ppo_micro_batch_size 32             | per_device_train_batch_size 32, grad. accum. 1  |
| actor.ppo_mini_batch_size 4 (one step)    | one optimizer step per 32 completions           |
| data.max_response_length 16               | max_completion_length 16                        |
| rollout.temperature 1.0                   | temperature 1.0                                 |
| actor.optim.lr 1e-5, AdamW, grad_clip 1.0 | learning_rate 1e-5, adamw, max_grad_norm 1.0    |
| actor.loss_agg_mode token-mean            | loss_type "dapo" (token-mean over the batch)    |
| use_rollout_log_probs (no old-logp pass)  | num_iterations 1 (no old-logp pass)             |
| no KL term                                | beta 0.0 (no reference model)                   |
| (no recomputation)                        | gradient_checkpointing False (TRL's default: on)|
| arithmetic scorer, format_score 0.2       | the same rules, in Python below                 |

Prints one JSON line per optimizer step on stdout: `{"step", "seconds", "gen_seconds",
"reward_seconds", "update_seconds", "reward_mean", "completion_length"}` where `gen_seconds`
is TRL's `_generate_and_score_completions` (generation, reward, advantages) and
`update_seconds` the rest of the step (forward, backward, AdamW).

usage: trl_grpo_peer.py --model-dir models --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
           --train datasets/arithmetic/train.parquet --steps 10 [--threads 2]
"""
import argparse
import json
import os
import re
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--gguf", required=True)
    p.add_argument("--train", required=True, help="Parquet file in VeRL's schema")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=32,
                   help="completions per forward/backward (per_device_train_batch_size); "
                        "gradients accumulate over 32 / this")
    p.add_argument("--output-dir", default="/tmp/trl-grpo-peer")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 autocast with f32 master weights (GRPOConfig bf16=True)")
    return p.parse_args()


# The arithmetic scorer (reward/src/arithmetic.rs), rule by rule.
_INTEGER_ALONE = re.compile(r"^[+-]?\d+\.?$")
_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.S)
_MARKER = re.compile(r"####\s*([+-]?)\s*(\d[\d,]*)")


def _parse_integer(text):
    t = re.sub(r"\s+", "", text)
    if t.endswith("."):
        t = t[:-1]
    return int(t) if re.fullmatch(r"[+-]?\d+", t) else None


def extract_answer(response):
    trimmed = response.strip()
    if _INTEGER_ALONE.match(trimmed):
        return int(trimmed.rstrip("."))
    end = response.rfind("</answer>")
    if end >= 0:
        start = response.rfind("<answer>", 0, end)
        if start >= 0:
            return _parse_integer(response[start + len("<answer>"):end])
    found = _MARKER.findall(response)
    if found:
        sign, digits = found[-1]
        return int(sign + digits.replace(",", ""))
    return None


def arithmetic_reward(completions, reward_model, **_):
    """1 for the right integer, 0.2 for an integer that is wrong, 0 for no integer."""
    scores = []
    for completion, rm in zip(completions, reward_model):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        answer = extract_answer(text)
        if answer is None:
            scores.append(0.0)
        else:
            scores.append(1.0 if answer == int(rm["ground_truth"]) else 0.2)
    return scores


def main():
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, gguf_file=args.gguf)
    dequantised = AutoModelForCausalLM.from_pretrained(
        args.model_dir, gguf_file=args.gguf, dtype=torch.float32
    )
    # A model loaded from GGUF is flagged as quantized and the Trainer refuses to train it; its
    # weights are already f32, so move them into a plain model of the same architecture.
    model = AutoModelForCausalLM.from_config(dequantised.config, dtype=torch.float32)
    model.load_state_dict(dequantised.state_dict())
    del dequantised
    dataset = load_dataset("parquet", data_files=args.train, split="train")

    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=32 // args.micro_batch,
        num_generations=8,
        max_completion_length=16,
        temperature=1.0,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_grad_norm=1.0,
        loss_type="dapo",
        beta=0.0,
        num_iterations=1,
        use_cpu=True,
        bf16=args.bf16,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        # TRL turns activation checkpointing on by default to save memory; it recomputes the
        # forward pass in the backward one. Off, as grpo's learner does not recompute either
        # (the peer at its fastest; both fit in memory easily at these sizes).
        gradient_checkpointing=False,
    )

    timings = {"gen": 0.0, "reward": 0.0}

    def timed_reward(*a, **kw):
        started = time.perf_counter()
        out = arithmetic_reward(*a, **kw)
        timings["reward"] += time.perf_counter() - started
        return out

    timed_reward.__name__ = "arithmetic"
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=timed_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        started = time.perf_counter()
        out = generate(*a, **kw)
        timings["gen"] += time.perf_counter() - started
        return out

    trainer._generate_and_score_completions = timed_generate

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            self.started = time.perf_counter()
            timings["gen"] = timings["reward"] = 0.0

        def on_log(self, args_, state, control, logs=None, **kw):
            self.logs = logs or {}

        def on_step_end(self, args_, state, control, **kw):
            self.seconds = time.perf_counter() - self.started
            self.step = state.global_step

    timer = StepTimer()

    class Reporter(TrainerCallback):
        # on_log runs after on_step_end for the same step: report once the logs are in.
        def on_log(self, args_, state, control, logs=None, **kw):
            logs = logs or {}
            if "reward" not in logs:
                return
            line = {
                "step": state.global_step,
                "seconds": timer.seconds,
                "gen_seconds": timings["gen"],
                "reward_seconds": timings["reward"],
                "update_seconds": timer.seconds - timings["gen"],
                "reward_mean": logs.get("reward"),
                "completion_length": logs.get("completions/mean_length"),
            }
            print(json.dumps(line), flush=True)

    trainer.add_callback(timer)
    trainer.add_callback(Reporter())
    trainer.train()


if __name__ == "__main__":
    sys.exit(main())
