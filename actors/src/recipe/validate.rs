//! Range and cross-key checks, run before any work starts. Each rule is stated in its message.

use super::load::locate_key;
use super::{Recipe, Strategy};
use std::fmt;

/// One broken rule: the key, its value, the rule, and where the key is written.
#[derive(Debug, Clone, PartialEq)]
pub struct Violation {
    pub key: String,
    pub value: String,
    pub rule: String,
    /// `file:line:column` where the key is written in the recipe, when it is.
    pub at: Option<String>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(at) = &self.at {
            write!(f, "{at}: ")?;
        }
        write!(f, "`{}` = {}: {}", self.key, self.value, self.rule)
    }
}

struct Checker<'a> {
    text: &'a str,
    file: &'a str,
    overrides: &'a [String],
    out: Vec<Violation>,
}

impl Checker<'_> {
    fn check(&mut self, ok: bool, key: &str, value: impl fmt::Display, rule: &str) {
        if !ok {
            // The last `--set` of a key wins, so it is the one to blame.
            let set = self
                .overrides
                .iter()
                .rev()
                .find(|raw| raw.split_once('=').is_some_and(|(k, _)| k.trim() == key));
            let at = match set {
                Some(raw) => Some(format!("--set {raw}")),
                None => locate_key(self.text, key).map(|(l, c)| format!("{}:{l}:{c}", self.file)),
            };
            self.out.push(Violation {
                key: key.into(),
                value: value.to_string(),
                rule: rule.into(),
                at,
            });
        }
    }
}

/// All rule violations of a recipe (empty when it is fine). `text` and `file` locate keys
/// written in the file; `overrides` (`KEY=VALUE`) are named instead for keys they set.
pub(crate) fn validate(r: &Recipe, text: &str, file: &str, overrides: &[String]) -> Vec<Violation> {
    let mut c = Checker {
        text,
        file,
        overrides,
        out: Vec::new(),
    };
    let d = &r.data;
    c.check(
        !d.train_files.0.is_empty(),
        "data.train_files",
        "[]",
        "must name at least one Parquet file",
    );
    c.check(
        d.train_batch_size > 0,
        "data.train_batch_size",
        d.train_batch_size,
        "must be at least 1",
    );
    c.check(
        d.max_prompt_length > 0,
        "data.max_prompt_length",
        d.max_prompt_length,
        "must be at least 1",
    );
    c.check(
        d.max_response_length > 0,
        "data.max_response_length",
        d.max_response_length,
        "must be at least 1",
    );
    if let Some(v) = d.val_batch_size {
        c.check(
            v > 0,
            "data.val_batch_size",
            v,
            "must be at least 1 (or left out for the whole set)",
        );
    }
    for (key, v) in [
        ("data.train_max_samples", d.train_max_samples),
        ("data.val_max_samples", d.val_max_samples),
    ] {
        c.check(
            v == -1 || v > 0,
            key,
            v,
            "must be -1 (all rows) or a positive count",
        );
    }

    let ro = &r.rollout;
    c.check(ro.n >= 1, "rollout.n", ro.n, "must be at least 1");
    c.check(
        ro.temperature >= 0.0 && ro.temperature.is_finite(),
        "rollout.temperature",
        ro.temperature,
        "must be 0 (greedy) or more",
    );
    c.check(
        ro.top_p > 0.0 && ro.top_p <= 1.0,
        "rollout.top_p",
        ro.top_p,
        "must be in (0, 1]",
    );
    c.check(
        ro.top_k == -1 || ro.top_k > 0,
        "rollout.top_k",
        ro.top_k,
        "must be -1 (all tokens) or at least 1",
    );
    c.check(
        ro.max_num_seqs >= 1,
        "rollout.max_num_seqs",
        ro.max_num_seqs,
        "must be at least 1",
    );
    c.check(
        ro.tensor_parallel_size >= 1,
        "rollout.tensor_parallel_size",
        ro.tensor_parallel_size,
        "must be at least 1",
    );
    let vk = &ro.val_kwargs;
    c.check(vk.n >= 1, "rollout.val_kwargs.n", vk.n, "must be at least 1");
    c.check(
        vk.temperature >= 0.0,
        "rollout.val_kwargs.temperature",
        vk.temperature,
        "must be 0 or more",
    );
    c.check(
        vk.top_p > 0.0 && vk.top_p <= 1.0,
        "rollout.val_kwargs.top_p",
        vk.top_p,
        "must be in (0, 1]",
    );
    c.check(
        vk.top_k == -1 || vk.top_k > 0,
        "rollout.val_kwargs.top_k",
        vk.top_k,
        "must be -1 (all tokens) or at least 1",
    );

    let rw = &r.reward;
    c.check(
        rw.num_workers >= 1,
        "reward.num_workers",
        rw.num_workers,
        "must be at least 1",
    );
    c.check(
        rw.time_limit_s > 0.0,
        "reward.time_limit_s",
        rw.time_limit_s,
        "must be more than 0 seconds",
    );

    let al = &r.algorithm;
    c.check(
        al.kl_coef >= 0.0,
        "algorithm.kl_coef",
        al.kl_coef,
        "must be 0 or more",
    );
    if let Some(t) = al.rollout_is_threshold {
        c.check(
            t >= 1.0,
            "algorithm.rollout_is_threshold",
            t,
            "must be at least 1 (it caps a probability ratio)",
        );
    }

    let a = &r.actor;
    c.check(
        a.ppo_mini_batch_size >= 1,
        "actor.ppo_mini_batch_size",
        a.ppo_mini_batch_size,
        "must be at least 1",
    );
    c.check(
        a.ppo_micro_batch_size >= 1,
        "actor.ppo_micro_batch_size",
        a.ppo_micro_batch_size,
        "must be at least 1",
    );
    if a.ppo_mini_batch_size >= 1 && d.train_batch_size >= 1 {
        c.check(
            d.train_batch_size.is_multiple_of(a.ppo_mini_batch_size),
            "actor.ppo_mini_batch_size",
            a.ppo_mini_batch_size,
            &format!(
                "must divide data.train_batch_size ({}) so every mini-batch is full",
                d.train_batch_size
            ),
        );
    }
    let seqs = a.ppo_mini_batch_size * ro.n;
    if a.ppo_micro_batch_size >= 1 && seqs >= 1 {
        c.check(
            seqs.is_multiple_of(a.ppo_micro_batch_size),
            "actor.ppo_micro_batch_size",
            a.ppo_micro_batch_size,
            &format!(
                "must divide the sequences of a mini-batch (actor.ppo_mini_batch_size x rollout.n = {} x {} = {seqs})",
                a.ppo_mini_batch_size, ro.n
            ),
        );
    }
    c.check(
        a.ppo_epochs >= 1,
        "actor.ppo_epochs",
        a.ppo_epochs,
        "must be at least 1",
    );
    c.check(
        a.clip_ratio_low > 0.0 && a.clip_ratio_low < 1.0,
        "actor.clip_ratio_low",
        a.clip_ratio_low,
        "must be in (0, 1)",
    );
    c.check(
        a.clip_ratio_high > 0.0 && a.clip_ratio_high < 1.0,
        "actor.clip_ratio_high",
        a.clip_ratio_high,
        "must be in (0, 1)",
    );
    c.check(
        a.clip_ratio_c > 1.0,
        "actor.clip_ratio_c",
        a.clip_ratio_c,
        "must be more than 1 (dual-clip lower bound)",
    );
    c.check(
        a.kl_loss_coef >= 0.0,
        "actor.kl_loss_coef",
        a.kl_loss_coef,
        "must be 0 or more",
    );
    c.check(
        a.entropy_coeff >= 0.0,
        "actor.entropy_coeff",
        a.entropy_coeff,
        "must be 0 or more",
    );
    c.check(
        a.grad_clip > 0.0,
        "actor.grad_clip",
        a.grad_clip,
        "must be more than 0",
    );
    c.check(
        a.max_consecutive_nonfinite >= 1,
        "actor.max_consecutive_nonfinite",
        a.max_consecutive_nonfinite,
        "must be at least 1",
    );
    if let Some(m) = a.mesh {
        c.check(m >= 1, "actor.mesh", m, "must be at least 1 device");
    }
    let mesh_text = a.mesh.map_or("null".to_string(), |m| m.to_string());
    if a.strategy == Strategy::Single {
        c.check(
            a.mesh.is_none_or(|m| m <= 1),
            "actor.mesh",
            &mesh_text,
            "applies to actor.strategy dp and fsdp; with single the learner uses one device",
        );
    } else {
        match a.parallelism(&r.cluster).mesh {
            None => c.check(
                false,
                "actor.mesh",
                &mesh_text,
                &format!(
                    "must be set with actor.strategy {} on cluster.device {}: the number of devices to \
                     shard the learner over (only on cpu does the recipe fix the device count, so only \
                     there may it default to all devices)",
                    a.strategy.name(),
                    r.cluster.device.name()
                ),
            ),
            Some(m) if m >= 1 && a.ppo_micro_batch_size >= 1 => c.check(
                a.ppo_micro_batch_size.is_multiple_of(m),
                "actor.ppo_micro_batch_size",
                a.ppo_micro_batch_size,
                &format!(
                    "must divide by actor.mesh ({m}{}): actor.strategy {} splits each micro-batch's \
                     rows evenly over the devices",
                    if a.mesh.is_none() {
                        ", all cluster.cpu_device_count devices"
                    } else {
                        ""
                    },
                    a.strategy.name()
                ),
            ),
            Some(_) => {}
        }
    }
    c.check(
        !(a.use_kl_loss && al.use_kl_in_reward),
        "actor.use_kl_loss",
        a.use_kl_loss,
        "KL is already in the reward (algorithm.use_kl_in_reward: true); use one of the two",
    );
    let o = &a.optim;
    c.check(
        o.lr > 0.0 && o.lr.is_finite(),
        "actor.optim.lr",
        o.lr,
        "must be more than 0",
    );
    c.check(
        o.betas.iter().all(|b| (0.0..1.0).contains(b)),
        "actor.optim.betas",
        format!("{:?}", o.betas),
        "each must be in [0, 1)",
    );
    c.check(o.eps > 0.0, "actor.optim.eps", o.eps, "must be more than 0");
    c.check(
        o.weight_decay >= 0.0,
        "actor.optim.weight_decay",
        o.weight_decay,
        "must be 0 or more",
    );
    c.check(
        (0.0..=1.0).contains(&o.min_lr_ratio),
        "actor.optim.min_lr_ratio",
        o.min_lr_ratio,
        "must be in [0, 1]",
    );

    let t = &r.trainer;
    c.check(
        t.total_epochs >= 1,
        "trainer.total_epochs",
        t.total_epochs,
        "must be at least 1",
    );
    if let Some(s) = t.total_training_steps {
        c.check(
            s >= 1,
            "trainer.total_training_steps",
            s,
            "must be at least 1 (or left out to run total_epochs)",
        );
    }
    c.check(
        t.save_freq == -1 || t.save_freq >= 1,
        "trainer.save_freq",
        t.save_freq,
        "must be -1 (never) or at least 1",
    );
    c.check(
        t.test_freq == -1 || t.test_freq >= 1,
        "trainer.test_freq",
        t.test_freq,
        "must be -1 (never) or at least 1",
    );
    if let Some(k) = t.max_checkpoints_to_keep {
        c.check(
            k >= 1,
            "trainer.max_checkpoints_to_keep",
            k,
            "must be at least 1 (or left out to keep all)",
        );
    }
    c.check(
        t.off_policy_steps <= 1,
        "trainer.off_policy_steps",
        t.off_policy_steps,
        "must be 0 (on-policy) or 1",
    );
    c.check(
        !t.output_dir.is_empty(),
        "trainer.output_dir",
        "\"\"",
        "must name a directory",
    );

    c.check(
        r.cluster.cpu_device_count >= 1,
        "cluster.cpu_device_count",
        r.cluster.cpu_device_count,
        "must be at least 1",
    );
    c.check(
        r.cluster.learner_workers <= 1,
        "cluster.learner_workers",
        r.cluster.learner_workers,
        "must be 0 (the learner in the orchestrator's process) or 1 (one learner worker process)",
    );
    c.check(
        r.cluster.worker_timeout_s > 0.0 && r.cluster.worker_timeout_s.is_finite(),
        "cluster.worker_timeout_s",
        r.cluster.worker_timeout_s,
        "must be a positive number of seconds",
    );
    if let Some(kind) = r.cluster.rollout_device {
        c.check(
            kind == r.cluster.device || r.cluster.rollout_workers > 0,
            "cluster.rollout_device",
            kind.name(),
            &format!(
                "applies to rollout worker processes, and `cluster.rollout_workers` is 0 (rollout \
                 runs in the orchestrator's process, on `cluster.device` = {}): start rollout \
                 workers or leave the key out",
                r.cluster.device.name()
            ),
        );
    }
    if let Some(kind) = r.cluster.learner_device {
        c.check(
            kind == r.cluster.device || r.cluster.learner_workers > 0,
            "cluster.learner_device",
            kind.name(),
            &format!(
                "applies to learner worker processes, and `cluster.learner_workers` is 0 (the \
                 learner runs in the orchestrator's process, on `cluster.device` = {}): start a \
                 learner worker or leave the key out",
                r.cluster.device.name()
            ),
        );
    }
    c.out
}

#[cfg(test)]
mod tests {
    use super::super::load::load_recipe_str;
    use super::*;

    fn violations(extra: &str) -> Vec<String> {
        let text = format!("model:\n  path: m\ndata:\n  train_files: t.parquet\n{extra}");
        let r = load_recipe_str(&text, "r.yaml").unwrap();
        validate(&r, &text, "r.yaml", &[])
            .iter()
            .map(|v| v.to_string())
            .collect()
    }

    #[test]
    fn a_rollout_device_needs_rollout_workers() {
        assert_eq!(
            violations("cluster:\n  rollout_device: cuda\n"),
            vec![
                "r.yaml:6:3: `cluster.rollout_device` = cuda: applies to rollout worker processes, \
                 and `cluster.rollout_workers` is 0 (rollout runs in the orchestrator's process, on \
                 `cluster.device` = cpu): start rollout workers or leave the key out"
            ]
        );
        assert!(violations("cluster:\n  rollout_device: cpu\n").is_empty());
        assert!(violations("cluster:\n  rollout_device: tpu\n  rollout_workers: 1\n").is_empty());
        assert_eq!(
            violations("cluster:\n  device: cuda\n  learner_device: tpu\n"),
            vec![
                "r.yaml:7:3: `cluster.learner_device` = tpu: applies to learner worker processes, \
                 and `cluster.learner_workers` is 0 (the learner runs in the orchestrator's \
                 process, on `cluster.device` = cuda): start a learner worker or leave the key out"
            ]
        );
        assert!(violations("cluster:\n  learner_device: cuda\n  learner_workers: 1\n").is_empty());
    }

    #[test]
    fn defaults_are_valid() {
        assert!(violations("").is_empty(), "{:?}", violations(""));
    }

    #[test]
    fn out_of_range_values_state_the_rule_and_line() {
        let v = violations("actor:\n  clip_ratio_low: 1.5\n");
        assert_eq!(
            v,
            vec!["r.yaml:6:3: `actor.clip_ratio_low` = 1.5: must be in (0, 1)"]
        );
        let v = violations("rollout:\n  temperature: -0.5\n");
        assert_eq!(
            v,
            vec!["r.yaml:6:3: `rollout.temperature` = -0.5: must be 0 (greedy) or more"]
        );
        let v = violations("rollout:\n  top_p: 0\n");
        assert_eq!(v, vec!["r.yaml:6:3: `rollout.top_p` = 0: must be in (0, 1]"]);
    }

    #[test]
    fn at_most_one_learner_worker() {
        assert!(violations("cluster:\n  learner_workers: 1\n").is_empty());
        assert_eq!(
            violations("cluster:\n  learner_workers: 2\n"),
            vec![
                "r.yaml:6:3: `cluster.learner_workers` = 2: must be 0 (the learner in the \
                 orchestrator's process) or 1 (one learner worker process)"
            ]
        );
    }

    #[test]
    fn sharded_learner_keys() {
        assert!(violations("actor:\n  strategy: fsdp\n  mesh: 4\n  ppo_micro_batch_size: 8\n").is_empty());
        assert!(violations("actor:\n  strategy: dp\ncluster:\n  cpu_device_count: 2\n").is_empty());
        assert_eq!(
            violations("actor:\n  strategy: dp\n  mesh: 3\n"),
            vec![
                "`actor.ppo_micro_batch_size` = 4: must divide by actor.mesh (3): \
                 actor.strategy dp splits each micro-batch's rows evenly over the devices"
            ]
        );
        assert_eq!(
            violations("actor:\n  strategy: fsdp\ncluster:\n  cpu_device_count: 8\n"),
            vec![
                "`actor.ppo_micro_batch_size` = 4: must divide by actor.mesh (8, all \
                 cluster.cpu_device_count devices): actor.strategy fsdp splits each micro-batch's rows \
                 evenly over the devices"
            ]
        );
        assert_eq!(
            violations("actor:\n  mesh: 2\n"),
            vec![
                "r.yaml:6:3: `actor.mesh` = 2: applies to actor.strategy dp and fsdp; with single the \
                 learner uses one device"
            ]
        );
        assert_eq!(
            violations("actor:\n  strategy: dp\ncluster:\n  device: tpu\n"),
            vec![
                "`actor.mesh` = null: must be set with actor.strategy dp on cluster.device \
                 tpu: the number of devices to shard the learner over (only on cpu does the recipe fix \
                 the device count, so only there may it default to all devices)"
            ]
        );
        let r = load_recipe_str(
            "model:\n  path: m\ndata:\n  train_files: t\nactor:\n  strategy: fsdp\n  mesh: 4\n",
            "r.yaml",
        )
        .unwrap();
        assert_eq!(r.cpu_devices(), 4, "the CPU client opens the mesh's devices");
        assert_eq!(
            r.actor.parallelism(&r.cluster),
            trainer::config::Parallelism::new(Strategy::Fsdp, 4)
        );
        let r = load_recipe_str("model:\n  path: m\ndata:\n  train_files: t\n", "r.yaml").unwrap();
        assert_eq!((r.actor.strategy, r.cpu_devices()), (Strategy::Single, 1));
    }

    #[test]
    fn batch_sizes_must_divide() {
        let text = "model:\n  path: m\ndata:\n  train_files: t\n  train_batch_size: 6\nactor:\n  ppo_mini_batch_size: 4\n  ppo_micro_batch_size: 3\n";
        let r = load_recipe_str(text, "r.yaml").unwrap();
        let v: Vec<String> = validate(&r, text, "r.yaml", &[])
            .iter()
            .map(|v| v.to_string())
            .collect();
        assert_eq!(
            v,
            vec![
                "r.yaml:7:3: `actor.ppo_mini_batch_size` = 4: must divide data.train_batch_size (6) so every mini-batch is full",
                "r.yaml:8:3: `actor.ppo_micro_batch_size` = 3: must divide the sequences of a mini-batch (actor.ppo_mini_batch_size x rollout.n = 4 x 4 = 16)",
            ]
        );
    }

    #[test]
    fn values_from_overrides_are_blamed_on_the_override() {
        let text = "model:\n  path: m\ndata:\n  train_files: t\n  train_batch_size: 8\n";
        let mut r = load_recipe_str(text, "r.yaml").unwrap();
        r.data.train_batch_size = 0;
        let v = validate(&r, text, "r.yaml", &["data.train_batch_size=0".into()]);
        assert_eq!(
            v[0].to_string(),
            "--set data.train_batch_size=0: `data.train_batch_size` = 0: must be at least 1"
        );
    }

    #[test]
    fn zero_batch_is_rejected() {
        let text = "model:\n  path: m\ndata:\n  train_files: t\n  train_batch_size: 0\n";
        let r = load_recipe_str(text, "r.yaml").unwrap();
        let v = validate(&r, text, "r.yaml", &[]);
        assert_eq!(
            v[0].to_string(),
            "r.yaml:5:3: `data.train_batch_size` = 0: must be at least 1"
        );
    }

    #[test]
    fn negative_batch_is_a_type_error() {
        let text = "model:\n  path: m\ndata:\n  train_files: t\n  train_batch_size: -4\n";
        let m = load_recipe_str(text, "r.yaml").unwrap_err().to_string();
        assert!(
            m.starts_with("r.yaml:5:21: `data.train_batch_size` expects a non-negative integer"),
            "{m}"
        );
    }
}
