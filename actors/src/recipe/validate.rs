//! Range and cross-key checks, run before any work starts. Each rule is stated in its message.

use super::locate::locate_key;
use super::{
    AdvantageEstimator, ClusterSection, KlControl, KlPenalty, Launcher, PolicyLossMode, Recipe, ResumeMode,
    Strategy,
};
use crate::roles::Role;
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
            // The last `--set` of a key (or of a section holding it) wins, so it is the one to
            // blame.
            let set = self.overrides.iter().rev().find(|raw| {
                raw.split_once('=').is_some_and(|(k, _)| {
                    let k = k.trim();
                    key.strip_prefix(k)
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
                })
            });
            let at = match set {
                Some(raw) => Some(format!("--set {raw}")),
                None => self.locate(key).map(|(l, c)| format!("{}:{l}:{c}", self.file)),
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

impl Checker<'_> {
    /// Where `key` is written; for a key inside a list entry written in flow style
    /// (`- {name: a, workers: 0}`), the entry or the list itself.
    fn locate(&self, key: &str) -> Option<(usize, usize)> {
        let mut key = key;
        loop {
            if let Some(at) = locate_key(self.text, key) {
                return Some(at);
            }
            if !key.contains('[') {
                return None;
            }
            let cut = key.rfind(['.', '['])?;
            key = &key[..cut];
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
        (0.0..=1.0).contains(&ro.min_p),
        "rollout.min_p",
        ro.min_p,
        "must be in [0, 1] (0 keeps all tokens)",
    );
    c.check(
        ro.min_p == 0.0 || ro.temperature > 0.0,
        "rollout.min_p",
        ro.min_p,
        "trims what sampling draws from, and with `rollout.temperature: 0` decoding is greedy; \
         set a temperature or leave min_p at 0",
    );
    c.check(
        ro.max_num_seqs >= 1,
        "rollout.max_num_seqs",
        ro.max_num_seqs,
        "must be at least 1",
    );
    c.check(
        ro.tensor_model_parallel_size >= 1,
        "rollout.tensor_model_parallel_size",
        ro.tensor_model_parallel_size,
        "must be at least 1 device",
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
        (0.0..=1.0).contains(&vk.min_p),
        "rollout.val_kwargs.min_p",
        vk.min_p,
        "must be in [0, 1] (0 keeps all tokens)",
    );
    c.check(
        vk.min_p == 0.0 || (vk.do_sample && vk.temperature > 0.0),
        "rollout.val_kwargs.min_p",
        vk.min_p,
        "trims what sampling draws from; validation samples only with `do_sample: true` and a \
         temperature above 0",
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
            Some(m) if m >= 1 && a.ppo_micro_batch_size >= 1 && a.tensor_model_parallel_size <= 1 => c.check(
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
            Some(m)
                if m >= 1
                    && a.ppo_micro_batch_size >= 1
                    && m.is_multiple_of(a.tensor_model_parallel_size) =>
            {
                let (tp, data) = (a.tensor_model_parallel_size, m / a.tensor_model_parallel_size);
                c.check(
                    a.ppo_micro_batch_size.is_multiple_of(data),
                    "actor.ppo_micro_batch_size",
                    a.ppo_micro_batch_size,
                    &format!(
                        "must divide by {data}, the data axis of actor.mesh ({m}) / \
                         actor.tensor_model_parallel_size ({tp}): actor.strategy {} splits each \
                         micro-batch's rows evenly over the data axis",
                        a.strategy.name()
                    ),
                )
            }
            Some(_) => {}
        }
    }
    check_tensor_parallel(&mut c, r);
    if !al.use_kl_in_reward {
        c.check(
            al.kl_penalty == KlPenalty::K1,
            "algorithm.kl_penalty",
            serde_json::to_value(al.kl_penalty)
                .expect("names serialize")
                .as_str()
                .unwrap_or_default()
                .to_string(),
            "is read only with algorithm.use_kl_in_reward: true",
        );
        c.check(
            al.kl_ctrl == KlControl::Fixed,
            "algorithm.kl_ctrl",
            "adaptive",
            "is read only with algorithm.use_kl_in_reward: true",
        );
    }
    if let KlControl::Adaptive { target_kl, horizon } = al.kl_ctrl {
        c.check(
            target_kl > 0.0,
            "algorithm.kl_ctrl.target_kl",
            target_kl,
            "must be above 0",
        );
        c.check(
            horizon > 0.0,
            "algorithm.kl_ctrl.horizon",
            horizon,
            "must be above 0",
        );
    }
    check_algorithm_knobs(&mut c, r);
    check_cpu_device_count(&mut c, r);
    check_critic(&mut c, r);
    check_lora(&mut c, r);
    check_multi_turn(&mut c, r);
    check_rollout_correction(&mut c, r);
    check_filter_groups(&mut c, r);
    c.check(
        !(a.use_kl_loss && al.use_kl_in_reward),
        "actor.use_kl_loss",
        a.use_kl_loss,
        "KL is already in the reward (algorithm.use_kl_in_reward: true); use one of the two",
    );
    // The trainer's own range checks of its loss and optimizer configs, located here.
    let trainer_checks = a
        .policy_loss(al)
        .violations()
        .into_iter()
        .chain(a.optim_config(1).violations());
    for v in trainer_checks {
        if let trainer::TrainerError::Config { key, value, message } = v {
            c.check(false, key, value, &message);
        }
    }
    let o = &a.optim;
    c.check(
        o.weight_decay >= 0.0,
        "actor.optim.weight_decay",
        o.weight_decay,
        "must be 0 or more",
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
        !t.val_only || t.val_before_train,
        "trainer.val_only",
        t.val_only,
        "validates before training and stops, so it needs trainer.val_before_train: true",
    );
    c.check(
        !t.val_only || !r.data.val_files.0.is_empty(),
        "trainer.val_only",
        t.val_only,
        "needs data.val_files to validate on",
    );
    c.check(
        t.resume_mode != ResumeMode::ResumePath || t.resume_from_path.is_some(),
        "trainer.resume_mode",
        "resume_path",
        "needs trainer.resume_from_path, a checkpoint directory (OUTPUT/checkpoints/step_N)",
    );
    c.check(
        t.resume_from_path.is_none() || t.resume_mode == ResumeMode::ResumePath,
        "trainer.resume_from_path",
        t.resume_from_path.as_deref().unwrap_or_default(),
        "is read only with trainer.resume_mode: resume_path; set that too, or remove this key",
    );
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
    check_cluster_launcher(&mut c, &r.cluster);
    if let Some(kind) = r
        .cluster
        .rollout_device
        .filter(|_| r.cluster.launcher == Launcher::Local)
    {
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
    if let Some(kind) = r
        .cluster
        .learner_device
        .filter(|_| r.cluster.launcher == Launcher::Local)
    {
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

/// `cluster.launcher` with `cluster.ray` and `cluster.pools`: which keys go with which launcher,
/// and the rules of each pool.
/// Tensor parallelism: the learner's model axis divides its mesh; the rollout's divides the
/// devices an engine runs on, its slot groups divide the slots, and a colocated rollout's mesh
/// nests with the learner's so the weight handoff can reshard on the devices.
fn check_tensor_parallel(c: &mut Checker<'_>, r: &Recipe) {
    let a = &r.actor;
    let tp = a.tensor_model_parallel_size;
    c.check(
        tp >= 1,
        "actor.tensor_model_parallel_size",
        tp,
        "must be at least 1 device",
    );
    if tp > 1 && a.strategy == Strategy::Single {
        c.check(
            false,
            "actor.tensor_model_parallel_size",
            tp,
            &format!(
                "tensor parallelism spans several devices; actor.strategy single uses one: set \
                 actor.strategy dp (parameters whole over the data axis) or fsdp (also split over \
                 it) with actor.mesh a multiple of {tp}"
            ),
        );
    }
    let mesh = a
        .parallelism(&r.cluster)
        .mesh
        .filter(|_| a.strategy != Strategy::Single);
    if let Some(m) = mesh.filter(|&m| m >= 1 && tp >= 1) {
        c.check(
            m.is_multiple_of(tp),
            "actor.mesh",
            m,
            &format!(
                "must be a multiple of actor.tensor_model_parallel_size ({tp}): the learner's mesh is \
                 data x model devices, {tp} on the model axis"
            ),
        );
    }
    let rtp = r.rollout.tensor_model_parallel_size;
    if rtp < 1 {
        return;
    }
    let devices = r.rollout_devices();
    let colocated = r.rollout_colocated();
    if colocated && rtp > 1 && mesh.unwrap_or(1) == 1 {
        c.check(
            false,
            "rollout.tensor_model_parallel_size",
            rtp,
            &format!(
                "an in-process rollout runs on the learner's devices and takes its weights from \
                 them on the devices, but the learner uses one: set actor.strategy dp or fsdp with \
                 actor.mesh a multiple of {rtp}, or run rollout workers (cluster.rollout_workers)"
            ),
        );
        return;
    }
    if !devices.is_multiple_of(rtp) {
        c.check(
            false,
            "rollout.tensor_model_parallel_size",
            rtp,
            &format!(
                "must divide the {devices} devices the in-process rollout shares with the learner \
                 (actor.mesh)"
            ),
        );
        return;
    }
    let groups = devices / rtp;
    if groups > 1 {
        let rule = if rtp > 1 {
            format!(
                "must divide by the {groups} slot groups of the rollout's {devices} devices ({rtp} \
                 tensor-parallel devices each): the rollout splits its KV-cache slots evenly over them"
            )
        } else {
            format!(
                "must divide by actor.mesh ({devices}): the in-process rollout runs on the learner's \
                 {devices} devices and splits its KV-cache slots evenly over them"
            )
        };
        c.check(
            r.rollout.max_num_seqs.is_multiple_of(groups),
            "rollout.max_num_seqs",
            r.rollout.max_num_seqs,
            &rule,
        );
    }
    if colocated
        && devices > 1
        && tp >= 1
        && devices.is_multiple_of(tp)
        && !(tp.is_multiple_of(rtp) || rtp.is_multiple_of(tp))
    {
        c.check(
            false,
            "rollout.tensor_model_parallel_size",
            rtp,
            &format!(
                "must divide or be a multiple of actor.tensor_model_parallel_size ({tp}): the \
                 colocated weight handoff reshards the learner's data x model mesh into the \
                 rollout's slot-group x model mesh on the same {devices} devices, which needs the \
                 two to nest"
            ),
        );
    }
}

fn check_cluster_launcher(c: &mut Checker<'_>, cluster: &ClusterSection) {
    match cluster.launcher {
        Launcher::Local => {
            c.check(
                cluster.ray.is_none(),
                "cluster.ray",
                "{...}",
                "applies to `cluster.launcher: ray` only (the launcher is `local`): set \
                 `cluster.launcher: ray` or remove the section",
            );
            c.check(
                cluster.pools.is_empty(),
                "cluster.pools",
                format!(
                    "[{}]",
                    cluster
                        .pools
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                "applies to `cluster.launcher: ray` only (the launcher is `local`, which starts \
                 `cluster.rollout_workers` / `reward_workers` / `learner_workers` on this host): set \
                 `cluster.launcher: ray` or remove the pools",
            );
        }
        Launcher::Ray => {
            c.check(
                cluster.ray.is_some(),
                "cluster.launcher",
                "ray",
                "needs `cluster.ray.address`, the Ray dashboard / Jobs API address (for example \
                 `ray: {address: http://127.0.0.1:8265}`)",
            );
            c.check(
                !cluster.pools.is_empty(),
                "cluster.launcher",
                "ray",
                "needs at least one pool in `cluster.pools` to place workers in (for example \
                 `pools: [{name: cpu-reward, device: cpu, roles: [reward], workers: 2}]`)",
            );
            if !cluster.pools.is_empty() {
                for role in [Role::Rollout, Role::Reward, Role::Learner] {
                    let served = cluster.pool_worker_count(role) > 0;
                    c.check(
                        served,
                        "cluster.pools",
                        cluster
                            .pools
                            .iter()
                            .map(|p| p.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                        &format!(
                            "has no pool for the `{role}` role: with `cluster.launcher: ray` every \
                             role runs as Ray jobs, so list `{role}` in the `roles` of a pool (for \
                             example `{{name: cpu-{role}, device: cpu, roles: [{role}], workers: 1}}`)",
                            role = role.name()
                        ),
                    );
                }
            }
            for (key, count, role) in [
                ("cluster.rollout_workers", cluster.rollout_workers, "rollout"),
                ("cluster.reward_workers", cluster.reward_workers, "reward"),
                ("cluster.learner_workers", cluster.learner_workers, "learner"),
            ] {
                c.check(
                    count == 0,
                    key,
                    count,
                    &format!(
                        "must be 0 with `cluster.launcher: ray`: the pools say how many workers run \
                         (`workers` of each pool listing `{role}` in its `roles`)"
                    ),
                );
            }
            for (key, kind) in [
                ("cluster.rollout_device", cluster.rollout_device),
                ("cluster.learner_device", cluster.learner_device),
            ] {
                if let Some(kind) = kind {
                    c.check(
                        false,
                        key,
                        kind.name(),
                        "applies to `cluster.launcher: local` only: with `ray` each pool's `device` \
                         says what its workers open; leave the key out",
                    );
                }
            }
        }
    }
    if let Some(ray) = &cluster.ray {
        c.check(
            ray.address.starts_with("http://") || ray.address.starts_with("https://"),
            "cluster.ray.address",
            format!("{:?}", ray.address),
            "must be the Ray dashboard's HTTP address, where its Jobs API answers (for example \
             `http://127.0.0.1:8265`; not a `ray://` client address)",
        );
        let host = ray.orchestrator_host.trim_matches(|ch| ch == '[' || ch == ']');
        let unspecified = host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_unspecified());
        c.check(
            !host.is_empty() && !unspecified,
            "cluster.ray.orchestrator_host",
            format!("{:?}", ray.orchestrator_host),
            "must be an address of this host that the Ray nodes can reach (workers dial it to \
             register), such as its IP or DNS name; not empty, 0.0.0.0 or ::",
        );
        c.check(
            ray.poll_interval_s > 0.0 && ray.poll_interval_s.is_finite(),
            "cluster.ray.poll_interval_s",
            ray.poll_interval_s,
            "must be a positive number of seconds",
        );
    }

    let mut learners = 0;
    for (i, pool) in cluster.pools.iter().enumerate() {
        let key = |field: &str| format!("cluster.pools[{i}].{field}");
        let name_ok = !pool.name.is_empty()
            && pool
                .name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch));
        c.check(
            name_ok,
            &key("name"),
            format!("{:?}", pool.name),
            "must be a non-empty name of letters, digits, `-`, `_` and `.` (it goes on the \
             workers' command line), e.g. `tpu-rollout`",
        );
        if let Some(first) = cluster.pools[..i].iter().position(|p| p.name == pool.name) {
            c.check(
                false,
                &key("name"),
                format!("{:?}", pool.name),
                &format!("is already the name of cluster.pools[{first}]; pool names must be unique"),
            );
        }
        c.check(
            pool.workers >= 1,
            &key("workers"),
            pool.workers,
            "must be at least 1 (workers per listed role); remove the pool to run none",
        );
        let roles = format!(
            "[{}]",
            pool.roles.iter().map(|r| r.name()).collect::<Vec<_>>().join(", ")
        );
        c.check(
            !pool.roles.is_empty(),
            &key("roles"),
            &roles,
            "must list at least one of `rollout`, `reward`, `learner`",
        );
        for (j, role) in pool.roles.iter().enumerate() {
            if pool.roles[..j].contains(role) {
                c.check(
                    false,
                    &key("roles"),
                    &roles,
                    &format!("lists `{}` twice; list each role once", role.name()),
                );
            }
        }
        if pool.roles.contains(&Role::Learner) {
            learners += pool.workers;
            if learners > 1 {
                let (field, value) = if pool.workers > 1 {
                    ("workers", pool.workers.to_string())
                } else {
                    ("roles", roles.clone())
                };
                c.check(
                    false,
                    &key(field),
                    value,
                    &format!(
                        "makes {learners} learner workers over all pools; there is at most one (the \
                         learner is not replicated: list `learner` in one pool with `workers: 1`)"
                    ),
                );
            }
        }
        for (field, amount) in [("num_cpus", pool.num_cpus), ("num_gpus", pool.num_gpus)] {
            c.check(
                amount >= 0.0 && amount.is_finite(),
                &key(field),
                amount,
                "must be 0 or more",
            );
        }
        for (resource, amount) in &pool.resources {
            let resource_key = key(&format!("resources.{resource}"));
            c.check(
                *amount >= 0.0 && amount.is_finite(),
                &resource_key,
                amount,
                "must be 0 or more",
            );
            if let Some(field) = match resource.as_str() {
                "CPU" => Some("num_cpus"),
                "GPU" => Some("num_gpus"),
                _ => None,
            } {
                c.check(
                    false,
                    &resource_key,
                    amount,
                    &format!(
                        "Ray takes CPUs and GPUs from their own fields: use `cluster.pools[{i}].{field}` \
                         instead"
                    ),
                );
            }
        }
    }
}

/// `algorithm.filter_groups` and `data.gen_batch_size`.
fn check_filter_groups(c: &mut Checker, r: &Recipe) {
    let fg = &r.algorithm.filter_groups;
    if !fg.enable {
        let off = "is read only with algorithm.filter_groups.enable: true";
        if let Some(m) = &fg.metric {
            c.check(false, "algorithm.filter_groups.metric", m, off);
        }
        c.check(
            fg.max_num_gen_batches == 0,
            "algorithm.filter_groups.max_num_gen_batches",
            fg.max_num_gen_batches,
            off,
        );
        if let Some(g) = r.data.gen_batch_size {
            c.check(g == r.data.train_batch_size, "data.gen_batch_size", g, off);
        }
        return;
    }
    match fg.metric.as_deref() {
        None => c.check(
            false,
            "algorithm.filter_groups.enable",
            true,
            "needs algorithm.filter_groups.metric: seq_reward (the reward), seq_final_reward, or \
             a named extra of the scorer such as acc",
        ),
        Some("seq_final_reward") => c.check(
            !r.algorithm.use_kl_in_reward,
            "algorithm.filter_groups.metric",
            "seq_final_reward",
            "with algorithm.use_kl_in_reward the final reward is known only inside the update, \
             after the step's samples are chosen; filter on seq_reward",
        ),
        Some(_) => {}
    }
}

/// `algorithm.rollout_correction`: its thresholds, its rejection criteria as VeRL parses them,
/// and the keys that only matter with another one set.
fn check_rollout_correction(c: &mut Checker, r: &Recipe) {
    let rc = &r.algorithm.rollout_correction;
    c.check(
        rc.rollout_is_threshold >= 1.0 && rc.rollout_is_threshold.is_finite(),
        "algorithm.rollout_correction.rollout_is_threshold",
        rc.rollout_is_threshold,
        "must be at least 1, since it caps a probability ratio",
    );
    c.check(
        rc.rollout_is.is_some() || !rc.rollout_is_batch_normalize,
        "algorithm.rollout_correction.rollout_is_batch_normalize",
        rc.rollout_is_batch_normalize,
        "is read only with algorithm.rollout_correction.rollout_is: token or sequence",
    );
    // VeRL's bypass mode recomputes weights and rejections per micro-batch against the current
    // policy; grpo corrects once per batch against the old log-probs, which bypass makes the
    // rollout's own, so there would be nothing to correct.
    let corrects = rc.rollout_is.is_some() || rc.rollout_rs.is_some();
    c.check(
        !(corrects && r.actor.use_rollout_log_probs),
        "actor.use_rollout_log_probs",
        true,
        "makes the rollout's log-probs the old log-probs, so algorithm.rollout_correction has no gap \
         to correct: leave rollout_is and rollout_rs empty, or recompute the old log-probs (false)",
    );
    let replay = r.actor.router_replay.mode;
    c.check(
        !(replay == trainer::config::RouterReplay::R2 && r.actor.use_rollout_log_probs),
        "actor.router_replay.mode",
        "R2",
        "replays the experts the learner's old-log-prob pass chose, and actor.use_rollout_log_probs \
         skips that pass: recompute the old log-probs (use_rollout_log_probs: false), or replay the \
         rollout's experts (R3)",
    );
    c.check(
        !(replay == trainer::config::RouterReplay::R3
            && r.rollout.enable_rollout_routing_replay == Some(false)),
        "rollout.enable_rollout_routing_replay",
        false,
        "R3 (actor.router_replay.mode) replays the experts the rollout records; leave this key unset \
         or true",
    );
    match (&rc.rollout_rs, &rc.rollout_rs_threshold) {
        (None, Some(t)) => c.check(
            false,
            "algorithm.rollout_correction.rollout_rs_threshold",
            t,
            "is read only with algorithm.rollout_correction.rollout_rs",
        ),
        (Some(options), _) => {
            if let Err(e) = rc.rejection() {
                c.check(false, "algorithm.rollout_correction.rollout_rs", options, &e);
            }
        }
        (None, None) => {}
    }
}

/// Multi-turn keys only with `rollout.multi_turn.enable`, at least one tool or environment, and
/// limits in range.
fn check_multi_turn(c: &mut Checker, r: &Recipe) {
    let mt = &r.rollout.multi_turn;
    if !mt.enable {
        c.check(
            *mt == super::MultiTurnSection::default(),
            "rollout.multi_turn",
            "set",
            "its keys are read only with rollout.multi_turn.enable: true; enable it or leave them out",
        );
        return;
    }
    if let Some(agent) = &mt.agent {
        check_agent_program(c, mt, agent);
    }
    c.check(
        mt.agent.is_some()
            || !mt.tools.is_empty()
            || mt.tool_config_path.is_some()
            || mt.interaction_config_path.is_some(),
        "rollout.multi_turn.tools",
        "[]",
        "episodes need at least one tool to call, e.g. tools: [calculator], a tool_config_path, an \
         interaction_config_path, or an agent program (agent.command)",
    );
    if let Some(path) = &mt.interaction_config_path {
        if let Err(e) = agent::config::load_interactions(path) {
            c.check(
                false,
                "rollout.multi_turn.interaction_config_path",
                path.display(),
                &e.message,
            );
        }
    }
    if let Some(turns) = mt.max_user_turns {
        c.check(
            mt.interaction_config_path.is_some(),
            "rollout.multi_turn.max_user_turns",
            turns,
            "counts an interaction's replies; set rollout.multi_turn.interaction_config_path or leave it out",
        );
    }
    if let Some(path) = &mt.tool_config_path {
        if let Err(e) = agent::config::load(path) {
            c.check(
                false,
                "rollout.multi_turn.tool_config_path",
                path.display(),
                &e.message,
            );
        }
    }
    if let Some(turns) = mt.max_assistant_turns {
        c.check(
            turns >= 1,
            "rollout.multi_turn.max_assistant_turns",
            turns,
            "must be at least 1",
        );
    }
    if let Some(t) = mt.max_turn_tokens {
        c.check(
            t >= 1 && t <= r.data.max_response_length,
            "rollout.multi_turn.max_turn_tokens",
            t,
            "must be from 1 to data.max_response_length (the whole response's budget)",
        );
    }
    c.check(
        mt.max_parallel_calls >= 1,
        "rollout.multi_turn.max_parallel_calls",
        mt.max_parallel_calls,
        "must be at least 1",
    );
    c.check(
        mt.max_tool_response_length >= 1,
        "rollout.multi_turn.max_tool_response_length",
        mt.max_tool_response_length,
        "must be at least 1 character",
    );
    c.check(
        mt.tool_timeout_s > 0.0 && mt.tool_timeout_s <= 3600.0,
        "rollout.multi_turn.tool_timeout_s",
        mt.tool_timeout_s,
        "must be a number of seconds above 0, at most 3600",
    );
}

/// An agent program runs its own tools and conversation: grpo's tool and interaction keys do
/// not apply beside it.
fn check_agent_program(c: &mut Checker, mt: &super::MultiTurnSection, agent: &super::AgentProgramSection) {
    c.check(
        agent.command.first().is_some_and(|p| !p.is_empty()),
        "rollout.multi_turn.agent.command",
        format!("{:?}", agent.command),
        "must name a program and its arguments, e.g. [python3, agents/solve.py]",
    );
    c.check(
        agent.timeout_s > 0.0 && agent.timeout_s <= 86400.0,
        "rollout.multi_turn.agent.timeout_s",
        agent.timeout_s,
        "must be a number of seconds above 0, at most 86400",
    );
    if let Some(path) = &agent.tool_schemas {
        if let Err(e) = agent::config::load_schemas(path) {
            c.check(
                false,
                "rollout.multi_turn.agent.tool_schemas",
                path.display(),
                &e.message,
            );
        }
    }
    let defaults = super::MultiTurnSection::default();
    let grpo_side = [
        ("tools", !mt.tools.is_empty()),
        ("tool_config_path", mt.tool_config_path.is_some()),
        ("interaction_config_path", mt.interaction_config_path.is_some()),
        ("max_user_turns", mt.max_user_turns.is_some()),
        (
            "max_parallel_calls",
            mt.max_parallel_calls != defaults.max_parallel_calls,
        ),
        (
            "max_tool_response_length",
            mt.max_tool_response_length != defaults.max_tool_response_length,
        ),
        (
            "tool_response_truncate_side",
            mt.tool_response_truncate_side != defaults.tool_response_truncate_side,
        ),
        ("tool_timeout_s", mt.tool_timeout_s != defaults.tool_timeout_s),
    ];
    for (key, set) in grpo_side {
        c.check(
            !set,
            &format!("rollout.multi_turn.{key}"),
            "set",
            "configures grpo's own tools and interactions, and with an agent program the program runs its \
             tools and conversation itself; leave it out (give the tools' schemas as agent.tool_schemas)",
        );
    }
}

/// LoRA's keys: alpha, targets and an adapter to continue only with a rank.
fn check_lora(c: &mut Checker, r: &Recipe) {
    let a = &r.actor;
    if a.lora_rank == 0 {
        c.check(
            a.lora_alpha == super::default_lora_alpha(),
            "actor.lora_alpha",
            a.lora_alpha,
            "is read only with actor.lora_rank above 0 (LoRA); set the rank or leave the key out",
        );
        c.check(
            a.target_modules == model::TargetModules::default(),
            "actor.target_modules",
            format!(
                "{:?}",
                a.target_modules.0.iter().map(|t| t.module()).collect::<Vec<_>>()
            ),
            "is read only with actor.lora_rank above 0 (LoRA); set the rank or leave the key out",
        );
        c.check(
            a.target_parameters.0.is_empty(),
            "actor.target_parameters",
            format!(
                "{:?}",
                a.target_parameters
                    .0
                    .iter()
                    .map(|t| t.module())
                    .collect::<Vec<_>>()
            ),
            "is read only with actor.lora_rank above 0 (LoRA); set the rank or leave the key out",
        );
        c.check(
            a.lora_form == crate::recipe::LoraFormName::default(),
            "actor.lora_form",
            format!("{:?}", a.lora_form),
            "is read only with actor.lora_rank above 0 (LoRA); set the rank or leave the key out",
        );
        c.check(
            r.model.lora_adapter_path.is_none(),
            "model.lora_adapter_path",
            r.model.lora_adapter_path.as_deref().unwrap_or(""),
            "needs actor.lora_rank set to the adapter's r (to generate with an adapter without \
             training it: grpo generate --adapter)",
        );
        return;
    }
    c.check(
        a.lora_alpha > 0.0 && a.lora_alpha.is_finite(),
        "actor.lora_alpha",
        a.lora_alpha,
        "must be a number above 0",
    );
    c.check(
        !a.target_modules.0.is_empty() || !a.target_parameters.0.is_empty(),
        "actor.target_modules",
        "[]",
        "names no projection, and actor.target_parameters no stacked experts: LoRA needs \
         something to adapt",
    );
}

/// PPO's critic: its section and warm-up are read only with `gae`, and its sizes obey the
/// actor's rules.
fn check_critic(c: &mut Checker, r: &Recipe) {
    let (cr, a) = (&r.critic, &r.actor);
    if !r.algorithm.adv_estimator.needs_critic() {
        let unset = super::CriticSection::default();
        let sections: [(&str, bool); 9] = [
            ("critic.model", cr.model == unset.model),
            ("critic.optim", cr.optim == unset.optim),
            ("critic.grad_clip", cr.grad_clip == unset.grad_clip),
            (
                "critic.cliprange_value",
                cr.cliprange_value == unset.cliprange_value,
            ),
            ("critic.loss_agg_mode", cr.loss_agg_mode == unset.loss_agg_mode),
            (
                "critic.ppo_mini_batch_size",
                cr.ppo_mini_batch_size == unset.ppo_mini_batch_size,
            ),
            (
                "critic.ppo_micro_batch_size",
                cr.ppo_micro_batch_size == unset.ppo_micro_batch_size,
            ),
            ("critic.ppo_epochs", cr.ppo_epochs == unset.ppo_epochs),
            ("trainer.critic_warmup", r.trainer.critic_warmup == 0),
        ];
        for (key, unset) in sections {
            c.check(
                unset,
                key,
                "(set)",
                "is read only with algorithm.adv_estimator: gae (PPO's critic)",
            );
        }
        return;
    }
    let (mini, micro) = (
        cr.ppo_mini_batch_size.unwrap_or(a.ppo_mini_batch_size),
        cr.ppo_micro_batch_size.unwrap_or(a.ppo_micro_batch_size),
    );
    c.check(
        mini >= 1,
        "critic.ppo_mini_batch_size",
        mini,
        "must be at least 1",
    );
    c.check(
        micro >= 1,
        "critic.ppo_micro_batch_size",
        micro,
        "must be at least 1",
    );
    c.check(
        cr.ppo_epochs.unwrap_or(1) >= 1,
        "critic.ppo_epochs",
        cr.ppo_epochs.unwrap_or(1),
        "must be at least 1",
    );
    let train = r.data.train_batch_size;
    if mini >= 1 && train >= 1 {
        c.check(
            train.is_multiple_of(mini),
            "critic.ppo_mini_batch_size",
            mini,
            &format!("must divide data.train_batch_size ({train}) so every mini-batch is full"),
        );
    }
    let seqs = mini * r.rollout.n;
    if micro >= 1 && seqs >= 1 {
        c.check(
            seqs.is_multiple_of(micro),
            "critic.ppo_micro_batch_size",
            micro,
            &format!(
                "must divide the sequences of a critic mini-batch (critic.ppo_mini_batch_size x \
                 rollout.n = {mini} x {} = {seqs})",
                r.rollout.n
            ),
        );
    }
    if let Ok(data) = a
        .parallelism(&r.cluster)
        .data_devices(a.ppo_micro_batch_size as i64)
    {
        if micro >= 1 && data > 1 {
            c.check(
                micro.is_multiple_of(data),
                "critic.ppo_micro_batch_size",
                micro,
                &format!(
                    "must divide by {data}, the learner's data devices: the critic splits each \
                     micro-batch's rows over them as the actor does"
                ),
            );
        }
    }
    c.check(
        cr.cliprange_value > 0.0,
        "critic.cliprange_value",
        cr.cliprange_value,
        "must be above 0",
    );
    let grad_clip = cr.grad_clip.unwrap_or(a.grad_clip);
    c.check(
        grad_clip >= 0.0,
        "critic.grad_clip",
        grad_clip,
        "must be 0 (none) or more",
    );
    let optim = super::ActorSection {
        optim: cr.optim.clone(),
        ..a.clone()
    }
    .optim_config(1);
    for v in optim.violations() {
        if let trainer::TrainerError::Config { key, value, message } = v {
            c.check(false, &key.replacen("actor.", "critic.", 1), value, &message);
        }
    }
    c.check(
        cr.optim.weight_decay >= 0.0,
        "critic.optim.weight_decay",
        cr.optim.weight_decay,
        "must be 0 or more",
    );
}

/// `cluster.cpu_device_count` sizes the CPU plugin's client, which a run opens only where a
/// role runs on the CPU (`cluster.device`, a worker's device, a Ray pool's).
fn check_cpu_device_count(c: &mut Checker, r: &Recipe) {
    let cl = &r.cluster;
    use super::DeviceKind;
    let cpu = cl.device == DeviceKind::Cpu
        || (cl.rollout_workers > 0 && cl.rollout_device_kind() == DeviceKind::Cpu)
        || (cl.learner_workers > 0 && cl.learner_device_kind() == DeviceKind::Cpu)
        || cl.pools.iter().any(|p| p.device == super::PoolDevice::Cpu);
    c.check(
        cpu || cl.cpu_device_count == 1,
        "cluster.cpu_device_count",
        cl.cpu_device_count,
        "sizes the CPU plugin's client, and no role of this run is on the CPU (cluster.device, \
         cluster.rollout_device and cluster.learner_device of the workers); remove it",
    );
}

/// The knobs of one estimator or loss set while another is chosen would silently do nothing;
/// each is refused unless its owner is chosen (VeRL reads them only there too).
fn check_algorithm_knobs(c: &mut Checker, r: &Recipe) {
    let (a, al) = (&r.actor, &r.algorithm);
    let defaults = trainer::config::PolicyLossConfig::default();
    let mode = a.policy_loss.loss_mode;
    let unset = |v: f64, d: f64| v == d;
    // The dual clip is vanilla PPO's; sapo (its soft gates), gpg (no ratio) and kl_cov (a KL
    // penalty on chosen tokens) clip nothing.
    let clips = !matches!(
        mode,
        PolicyLossMode::Sapo | PolicyLossMode::Gpg | PolicyLossMode::KlCov
    );
    let owned: [(&str, f64, f64, bool, &str); 12] = [
        (
            "actor.clip_ratio_c",
            a.clip_ratio_c,
            defaults.clip_ratio_c,
            mode == PolicyLossMode::Vanilla,
            "actor.policy_loss.loss_mode: vanilla (PPO's dual clip)",
        ),
        (
            "actor.clip_ratio_low",
            a.clip_ratio_low,
            defaults.clip_ratio_low,
            clips,
            "a loss that clips the ratio (vanilla, gspo, cispo, geo_mean, clip_cov)",
        ),
        (
            "actor.clip_ratio_high",
            a.clip_ratio_high,
            defaults.clip_ratio_high,
            clips,
            "a loss that clips the ratio (vanilla, gspo, cispo, geo_mean, clip_cov)",
        ),
        (
            "algorithm.gamma",
            al.gamma,
            trainer::config::AdvantageConfig::default().gamma,
            matches!(
                al.adv_estimator,
                AdvantageEstimator::ReinforcePlusPlus | AdvantageEstimator::Gae
            ),
            "algorithm.adv_estimator: reinforce_plus_plus or gae",
        ),
        (
            "algorithm.lam",
            al.lam,
            trainer::config::AdvantageConfig::default().lam,
            al.adv_estimator == AdvantageEstimator::Gae,
            "algorithm.adv_estimator: gae",
        ),
        (
            "actor.tau_pos",
            a.tau_pos,
            defaults.tau_pos,
            mode == PolicyLossMode::Sapo,
            "actor.policy_loss.loss_mode: sapo",
        ),
        (
            "actor.tau_neg",
            a.tau_neg,
            defaults.tau_neg,
            mode == PolicyLossMode::Sapo,
            "actor.policy_loss.loss_mode: sapo",
        ),
        (
            "actor.policy_loss.clip_cov_ratio",
            a.policy_loss.clip_cov_ratio,
            defaults.clip_cov_ratio,
            mode == PolicyLossMode::ClipCov,
            "actor.policy_loss.loss_mode: clip_cov",
        ),
        (
            "actor.policy_loss.clip_cov_lb",
            a.policy_loss.clip_cov_lb,
            defaults.clip_cov_lb,
            mode == PolicyLossMode::ClipCov,
            "actor.policy_loss.loss_mode: clip_cov",
        ),
        (
            "actor.policy_loss.clip_cov_ub",
            a.policy_loss.clip_cov_ub,
            defaults.clip_cov_ub,
            mode == PolicyLossMode::ClipCov,
            "actor.policy_loss.loss_mode: clip_cov",
        ),
        (
            "actor.policy_loss.kl_cov_ratio",
            a.policy_loss.kl_cov_ratio,
            defaults.kl_cov_ratio,
            mode == PolicyLossMode::KlCov,
            "actor.policy_loss.loss_mode: kl_cov",
        ),
        (
            "actor.policy_loss.ppo_kl_coef",
            a.policy_loss.ppo_kl_coef,
            defaults.ppo_kl_coef,
            mode == PolicyLossMode::KlCov,
            "actor.policy_loss.loss_mode: kl_cov",
        ),
    ];
    for (key, value, default, chosen, owner) in owned {
        c.check(
            chosen || unset(value, default),
            key,
            value,
            &format!("is read only with {owner}"),
        );
    }
    c.check(
        (0.0..=1.0).contains(&al.gamma),
        "algorithm.gamma",
        al.gamma,
        "a discount: must be in [0, 1]",
    );
    c.check(
        (0.0..=1.0).contains(&al.lam),
        "algorithm.lam",
        al.lam,
        "GAE's lambda: must be in [0, 1]",
    );
    c.check(
        al.adv_estimator != AdvantageEstimator::GrpoPassk || r.rollout.n >= 2,
        "algorithm.adv_estimator",
        "grpo_passk",
        "compares each group's best response with its runner-up: set rollout.n to 2 or more",
    );
}

#[cfg(test)]
mod tests {
    use super::super::load::load_recipe_str;
    use super::super::{ActorSection, AlgorithmSection};
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
    fn router_replay_modes_need_what_they_replay() {
        let v = violations("actor:\n  use_rollout_log_probs: true\n  router_replay:\n    mode: R2\n");
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            v[0].starts_with("r.yaml:8:5: `actor.router_replay.mode` = R2: replays the experts the learner's old-log-prob pass chose"),
            "{v:?}"
        );
        let v = violations(
            "actor:\n  router_replay:\n    mode: R3\nrollout:\n  enable_rollout_routing_replay: false\n",
        );
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            v[0].starts_with("r.yaml:9:3: `rollout.enable_rollout_routing_replay` = false: R3"),
            "{v:?}"
        );
        assert!(violations("actor:\n  router_replay:\n    mode: R3\n").is_empty());
    }

    #[test]
    fn max_user_turns_needs_an_interaction() {
        assert_eq!(
            violations("rollout:\n  multi_turn:\n    enable: true\n    tools: [calculator]\n    max_user_turns: 2\n"),
            ["r.yaml:9:5: `rollout.multi_turn.max_user_turns` = 2: counts an interaction's replies; set rollout.multi_turn.interaction_config_path or leave it out"]
        );
    }

    #[test]
    fn an_agent_program_needs_a_command_and_excludes_grpos_tools() {
        assert!(violations(
            "rollout:\n  multi_turn:\n    enable: true\n    agent:\n      command: [python3, a.py]\n"
        )
        .is_empty());
        assert_eq!(
            violations(
                "rollout:\n  multi_turn:\n    enable: true\n    tools: [calculator]\n    tool_timeout_s: 5\n    \
                 agent:\n      command: []\n      timeout_s: 0\n      tool_schemas: /no/such/tools.yaml\n"
            ),
            [
                "r.yaml:11:7: `rollout.multi_turn.agent.command` = []: must name a program and its arguments, e.g. [python3, agents/solve.py]",
                "r.yaml:12:7: `rollout.multi_turn.agent.timeout_s` = 0: must be a number of seconds above 0, at most 86400",
                "r.yaml:13:7: `rollout.multi_turn.agent.tool_schemas` = /no/such/tools.yaml: cannot be read: No such file or directory (os error 2)",
                "r.yaml:8:5: `rollout.multi_turn.tools` = set: configures grpo's own tools and interactions, and with an agent program the program runs its tools and conversation itself; leave it out (give the tools' schemas as agent.tool_schemas)",
                "r.yaml:9:5: `rollout.multi_turn.tool_timeout_s` = set: configures grpo's own tools and interactions, and with an agent program the program runs its tools and conversation itself; leave it out (give the tools' schemas as agent.tool_schemas)",
            ]
        );
    }

    #[test]
    fn multi_turn_keys_need_multi_turn_and_a_tool() {
        assert_eq!(
            violations("rollout:\n  multi_turn:\n    format: llama3\n"),
            ["r.yaml:6:3: `rollout.multi_turn` = set: its keys are read only with rollout.multi_turn.enable: true; enable it or leave them out"]
        );
        assert_eq!(
            violations(
                "rollout:\n  multi_turn:\n    enable: true\n    max_assistant_turns: 0\n    max_turn_tokens: 5000\n    \
                 max_parallel_calls: 0\n    tool_timeout_s: .nan\n"
            ),
            [
                "`rollout.multi_turn.tools` = []: episodes need at least one tool to call, e.g. tools: [calculator], a tool_config_path, an interaction_config_path, or an agent program (agent.command)",
                "r.yaml:8:5: `rollout.multi_turn.max_assistant_turns` = 0: must be at least 1",
                "r.yaml:9:5: `rollout.multi_turn.max_turn_tokens` = 5000: must be from 1 to data.max_response_length (the whole response's budget)",
                "r.yaml:10:5: `rollout.multi_turn.max_parallel_calls` = 0: must be at least 1",
                "r.yaml:11:5: `rollout.multi_turn.tool_timeout_s` = NaN: must be a number of seconds above 0, at most 3600",
            ]
        );
        assert!(
            violations("rollout:\n  multi_turn:\n    enable: true\n    tools: [calculator]\n").is_empty()
        );
    }

    #[test]
    fn kl_in_reward_keys_need_the_kl_in_the_reward() {
        assert_eq!(
            violations("algorithm:\n  kl_penalty: low_var_kl\n  kl_ctrl: {type: adaptive, horizon: 0}\n"),
            [
                "r.yaml:6:3: `algorithm.kl_penalty` = low_var_kl: is read only with algorithm.use_kl_in_reward: true",
                "r.yaml:7:3: `algorithm.kl_ctrl` = adaptive: is read only with algorithm.use_kl_in_reward: true",
                "`algorithm.kl_ctrl.horizon` = 0: must be above 0",
            ]
        );
        assert!(violations(
            "algorithm:\n  use_kl_in_reward: true\n  kl_penalty: k3\n  kl_ctrl: {type: adaptive}\n"
        )
        .is_empty());
    }

    #[test]
    fn the_critic_is_read_only_with_gae_and_sized_like_the_actor() {
        assert_eq!(
            violations("algorithm:\n  lam: 0.9\ncritic:\n  cliprange_value: 0.2\ntrainer:\n  critic_warmup: 2\n"),
            [
                "r.yaml:6:3: `algorithm.lam` = 0.9: is read only with algorithm.adv_estimator: gae",
                "r.yaml:8:3: `critic.cliprange_value` = (set): is read only with algorithm.adv_estimator: gae (PPO's critic)",
                "r.yaml:10:3: `trainer.critic_warmup` = (set): is read only with algorithm.adv_estimator: gae (PPO's critic)",
            ]
        );
        assert_eq!(
            violations(
                "algorithm:\n  adv_estimator: gae\n  lam: 1.5\ncritic:\n  ppo_mini_batch_size: 3\n  \
                 ppo_micro_batch_size: 5\n  cliprange_value: 0\n  optim:\n    lr: -1\n"
            ),
            [
                "r.yaml:7:3: `algorithm.lam` = 1.5: GAE's lambda: must be in [0, 1]",
                "r.yaml:9:3: `critic.ppo_mini_batch_size` = 3: must divide data.train_batch_size (1024) so every mini-batch is full",
                "r.yaml:10:3: `critic.ppo_micro_batch_size` = 5: must divide the sequences of a critic mini-batch (critic.ppo_mini_batch_size x rollout.n = 3 x 4 = 12)",
                "r.yaml:11:3: `critic.cliprange_value` = 0: must be above 0",
                "r.yaml:13:5: `critic.optim.lr` = -1: must be a finite number > 0",
            ]
        );
        assert!(
            violations("algorithm:\n  adv_estimator: gae\n  lam: 0.95\ntrainer:\n  critic_warmup: 3\n")
                .is_empty()
        );
    }

    #[test]
    fn estimator_and_loss_knobs_need_their_owner() {
        assert_eq!(
            violations(
                "algorithm:\n  gamma: 0.9\nactor:\n  tau_pos: 2\n  policy_loss:\n    loss_mode: kl_cov\n    \
                 clip_cov_ub: 3\n    kl_cov_ratio: 0\n"
            ),
            [
                "r.yaml:6:3: `algorithm.gamma` = 0.9: is read only with algorithm.adv_estimator: reinforce_plus_plus or gae",
                "r.yaml:8:3: `actor.tau_pos` = 2: is read only with actor.policy_loss.loss_mode: sapo",
                "r.yaml:11:5: `actor.policy_loss.clip_cov_ub` = 3: is read only with actor.policy_loss.loss_mode: clip_cov",
                "r.yaml:12:5: `actor.policy_loss.kl_cov_ratio` = 0: a share of the tokens: must be in (0, 1]",
            ]
        );
        assert!(violations(
            "algorithm:\n  adv_estimator: reinforce_plus_plus\n  gamma: 0.9\nactor:\n  tau_neg: 2\n  \
             policy_loss: {loss_mode: sapo}\n"
        )
        .is_empty());
        assert_eq!(
            violations("algorithm:\n  adv_estimator: grpo_passk\nrollout:\n  n: 1\n"),
            [
                "r.yaml:6:3: `algorithm.adv_estimator` = grpo_passk: compares each group's best response with its \
                 runner-up: set rollout.n to 2 or more"
            ]
        );
    }

    #[test]
    fn rollout_correction_keys_are_checked_as_verl_parses_them() {
        assert_eq!(
            violations(
                "algorithm:\n  rollout_correction:\n    rollout_is_threshold: 0.5\n    rollout_is_batch_normalize: true\n    \
                 rollout_rs: token_k1,seq_max_k1\n    rollout_rs_threshold: 2\n"
            ),
            [
                "r.yaml:7:5: `algorithm.rollout_correction.rollout_is_threshold` = 0.5: must be at least 1, since it caps \
                 a probability ratio",
                "r.yaml:8:5: `algorithm.rollout_correction.rollout_is_batch_normalize` = true: is read only with \
                 algorithm.rollout_correction.rollout_is: token or sequence",
                "r.yaml:9:5: `algorithm.rollout_correction.rollout_rs` = token_k1,seq_max_k1: unknown option `seq_max_k1`; \
                 the options are token_k1, token_k2, token_k3, seq_sum_k1, seq_sum_k2, seq_sum_k3, seq_mean_k1, \
                 seq_mean_k2, seq_mean_k3, seq_max_k2, seq_max_k3",
            ]
        );
        assert_eq!(
            violations("algorithm:\n  rollout_correction:\n    rollout_rs_threshold: 0.1\n"),
            [
                "r.yaml:7:5: `algorithm.rollout_correction.rollout_rs_threshold` = 0.1: is read only with \
              algorithm.rollout_correction.rollout_rs"
            ]
        );
        assert_eq!(
            violations("algorithm:\n  rollout_correction:\n    rollout_is: sequence\nactor:\n  use_rollout_log_probs: true\n"),
            ["r.yaml:9:3: `actor.use_rollout_log_probs` = true: makes the rollout's log-probs the old log-probs, so \
              algorithm.rollout_correction has no gap to correct: leave rollout_is and rollout_rs empty, or recompute \
              the old log-probs (false)"]
        );
        assert!(violations(
            "algorithm:\n  rollout_correction:\n    rollout_is: sequence\n    rollout_is_batch_normalize: true\n    \
             rollout_rs: token_k1,seq_mean_k3\n    rollout_rs_threshold: \"0.5_2.0,0.01\"\n"
        )
        .is_empty());
    }

    #[test]
    fn filter_groups_needs_a_metric_and_owns_its_keys() {
        assert_eq!(
            violations("algorithm:\n  filter_groups:\n    metric: acc\n    max_num_gen_batches: 4\n"),
            [
                "r.yaml:7:5: `algorithm.filter_groups.metric` = acc: is read only with algorithm.filter_groups.enable: true",
                "r.yaml:8:5: `algorithm.filter_groups.max_num_gen_batches` = 4: is read only with \
                 algorithm.filter_groups.enable: true",
            ]
        );
        assert_eq!(
            violations("algorithm:\n  filter_groups:\n    enable: true\n"),
            ["r.yaml:7:5: `algorithm.filter_groups.enable` = true: needs algorithm.filter_groups.metric: seq_reward \
              (the reward), seq_final_reward, or a named extra of the scorer such as acc"]
        );
        assert_eq!(
            violations(
                "algorithm:\n  use_kl_in_reward: true\n  filter_groups:\n    enable: true\n    metric: seq_final_reward\n"
            ),
            ["r.yaml:9:5: `algorithm.filter_groups.metric` = seq_final_reward: with algorithm.use_kl_in_reward the \
              final reward is known only inside the update, after the step's samples are chosen; filter on seq_reward"]
        );
        assert!(violations(
            "algorithm:\n  filter_groups: {enable: true, metric: acc, max_num_gen_batches: 10}\n"
        )
        .is_empty());
    }

    #[test]
    fn loss_and_optimizer_keys_default_to_the_trainers_defaults() {
        let actor = ActorSection::default();
        assert_eq!(
            actor.policy_loss(&AlgorithmSection::default()),
            trainer::config::PolicyLossConfig::default()
        );
        let optim = trainer::config::OptimConfig::default();
        assert_eq!(actor.optim_config(optim.total_training_steps), optim);
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

    /// A ray cluster section (lines 5-9) followed by `pools` (from line 10); the violations
    /// other than roles without a pool (see [`roles_without_a_pool`]).
    fn ray_violations(pools: &str) -> Vec<String> {
        ray_rules(violations(&format!(
            "cluster:\n  launcher: ray\n  ray:\n    address: http://127.0.0.1:8265\n  pools:\n{pools}"
        )))
    }

    /// `v` without the "has no pool for the ROLE role" violations, for tests of other rules
    /// whose pools serve only some roles.
    fn ray_rules(v: Vec<String>) -> Vec<String> {
        v.into_iter()
            .filter(|m| !m.contains("has no pool for the"))
            .collect()
    }

    #[test]
    fn roles_without_a_pool() {
        assert_eq!(
            violations(
                "cluster:\n  launcher: ray\n  ray: {address: http://h:8265}\n  pools:\n    \
                 - {name: tpu, roles: [rollout]}\n    - {name: cpu, roles: [reward]}\n"
            ),
            vec![
                "r.yaml:8:3: `cluster.pools` = tpu, cpu: has no pool for the `learner` role: with \
                 `cluster.launcher: ray` every role runs as Ray jobs, so list `learner` in the \
                 `roles` of a pool (for example `{name: cpu-learner, device: cpu, roles: [learner], \
                 workers: 1}`)"
            ]
        );
    }

    #[test]
    fn a_ray_cluster_with_pools_is_valid_and_lists_its_workers() {
        let text = "model:\n  path: m\ndata:\n  train_files: t.parquet\ncluster:\n  launcher: ray\n  \
                    ray:\n    address: http://127.0.0.1:8265\n  pools:\n    - name: tpu-rollout\n      \
                    device: tpu\n      roles: [rollout]\n      resources: {TPU: 4}\n    - name: gpu\n      \
                    device: gpu\n      roles: [rollout, learner]\n      num_gpus: 1\n    - name: cpu\n      \
                    roles: [reward]\n      workers: 2\n      num_cpus: 0.5\n";
        let r = load_recipe_str(text, "r.yaml").unwrap();
        assert!(validate(&r, text, "r.yaml", &[]).is_empty());
        let c = &r.cluster;
        assert_eq!(c.launcher, Launcher::Ray);
        let ray = c.ray.as_ref().unwrap();
        assert_eq!(
            (
                ray.orchestrator_host.as_str(),
                ray.max_resubmits,
                ray.poll_interval_s
            ),
            ("127.0.0.1", 3, 1.0)
        );
        assert_eq!(c.pools[0].device.kind(), super::super::DeviceKind::Tpu);
        assert_eq!(c.pools[1].device.kind(), super::super::DeviceKind::Cuda);
        assert_eq!((c.pools[2].device.name(), c.pools[2].num_cpus), ("cpu", 0.5));
        assert_eq!(c.pools[0].resources.get("TPU"), Some(&4.0));
        assert_eq!(
            (c.pools[0].workers, c.pools[0].num_cpus, c.pools[0].num_gpus),
            (1, 1.0, 0.0)
        );
        assert_eq!(c.pool_worker_count(Role::Rollout), 2);
        assert_eq!(c.pool_worker_count(Role::Reward), 2);
        assert_eq!(c.pool_worker_count(Role::Learner), 1);
        let listed: Vec<(&str, &str, usize, String)> = c
            .pool_workers()
            .iter()
            .map(|w| (w.pool.name.as_str(), w.role.name(), w.index, w.worker_id(1)))
            .collect();
        let expected = [
            ("tpu-rollout", "rollout", 0, "rollout-0-a1"),
            ("gpu", "rollout", 1, "rollout-1-a1"),
            ("gpu", "learner", 0, "learner-0-a1"),
            ("cpu", "reward", 0, "reward-0-a1"),
            ("cpu", "reward", 1, "reward-1-a1"),
        ];
        assert_eq!(
            listed,
            expected
                .iter()
                .map(|(p, r, i, id)| (*p, *r, *i, id.to_string()))
                .collect::<Vec<_>>()
        );
        assert_eq!(c.pool("gpu").map(|p| p.num_gpus), Some(1.0));
        assert!(c.pool("nope").is_none());
        // The defaults: no pools, so every role runs in the orchestrator's process.
        let d = ClusterSection::default();
        assert_eq!(
            (d.pool_worker_count(Role::Rollout), d.pool_workers().len()),
            (0, 0)
        );
    }

    #[test]
    fn the_ray_launcher_needs_its_address_and_pools() {
        assert_eq!(
            violations("cluster:\n  launcher: ray\n"),
            vec![
                "r.yaml:6:3: `cluster.launcher` = ray: needs `cluster.ray.address`, the Ray dashboard \
                 / Jobs API address (for example `ray: {address: http://127.0.0.1:8265}`)",
                "r.yaml:6:3: `cluster.launcher` = ray: needs at least one pool in `cluster.pools` to \
                 place workers in (for example `pools: [{name: cpu-reward, device: cpu, roles: \
                 [reward], workers: 2}]`)",
            ]
        );
    }

    #[test]
    fn ray_keys_are_refused_with_the_local_launcher() {
        assert_eq!(
            violations(
                "cluster:\n  ray:\n    address: http://h:8265\n  pools:\n    - {name: a, roles: [reward]}\n"
            ),
            vec![
                "r.yaml:6:3: `cluster.ray` = {...}: applies to `cluster.launcher: ray` only (the \
                 launcher is `local`): set `cluster.launcher: ray` or remove the section",
                "r.yaml:8:3: `cluster.pools` = [a]: applies to `cluster.launcher: ray` only (the \
                 launcher is `local`, which starts `cluster.rollout_workers` / `reward_workers` / \
                 `learner_workers` on this host): set `cluster.launcher: ray` or remove the pools",
            ]
        );
    }

    #[test]
    fn local_worker_counts_and_devices_are_refused_with_ray() {
        let v = ray_rules(violations(
            "cluster:\n  launcher: ray\n  ray: {address: http://h:8265}\n  pools: [{name: a, roles: [reward]}]\n  \
             rollout_workers: 2\n  learner_workers: 1\n  rollout_device: tpu\n",
        ));
        assert_eq!(
            v,
            vec![
                "r.yaml:9:3: `cluster.rollout_workers` = 2: must be 0 with `cluster.launcher: ray`: \
                 the pools say how many workers run (`workers` of each pool listing `rollout` in its \
                 `roles`)",
                "r.yaml:10:3: `cluster.learner_workers` = 1: must be 0 with `cluster.launcher: ray`: \
                 the pools say how many workers run (`workers` of each pool listing `learner` in its \
                 `roles`)",
                "r.yaml:11:3: `cluster.rollout_device` = tpu: applies to `cluster.launcher: local` \
                 only: with `ray` each pool's `device` says what its workers open; leave the key out",
            ]
        );
        let v = ray_rules(violations(
            "cluster:\n  launcher: ray\n  ray: {address: http://h:8265}\n  pools: [{name: a, roles: [reward]}]\n  \
             reward_workers: 1\n  learner_device: cuda\n",
        ));
        assert_eq!(
            v,
            vec![
                "r.yaml:9:3: `cluster.reward_workers` = 1: must be 0 with `cluster.launcher: ray`: \
                 the pools say how many workers run (`workers` of each pool listing `reward` in its \
                 `roles`)",
                "r.yaml:10:3: `cluster.learner_device` = cuda: applies to `cluster.launcher: local` \
                 only: with `ray` each pool's `device` says what its workers open; leave the key out",
            ]
        );
    }

    #[test]
    fn ray_section_values_are_checked() {
        let v = ray_rules(violations(
            "cluster:\n  launcher: ray\n  ray:\n    address: ray://h:10001\n    orchestrator_host: 0.0.0.0\n    \
             poll_interval_s: 0\n  pools: [{name: a, roles: [reward]}]\n",
        ));
        assert_eq!(
            v,
            vec![
                "r.yaml:8:5: `cluster.ray.address` = \"ray://h:10001\": must be the Ray dashboard's HTTP \
                 address, where its Jobs API answers (for example `http://127.0.0.1:8265`; not a \
                 `ray://` client address)",
                "r.yaml:9:5: `cluster.ray.orchestrator_host` = \"0.0.0.0\": must be an address of this \
                 host that the Ray nodes can reach (workers dial it to register), such as its IP or \
                 DNS name; not empty, 0.0.0.0 or ::",
                "r.yaml:10:5: `cluster.ray.poll_interval_s` = 0: must be a positive number of seconds",
            ]
        );
        let v = ray_rules(violations(
            "cluster:\n  launcher: ray\n  ray: {address: 'https://h:8265', orchestrator_host: '[::]'}\n  \
             pools: [{name: a, roles: [reward]}]\n",
        ));
        assert_eq!(v.len(), 1, "{v:?}");
        // Written in flow style, the key has no line of its own to point at.
        assert!(
            v[0].starts_with("`cluster.ray.orchestrator_host` = \"[::]\": must be"),
            "{v:?}"
        );
    }

    #[test]
    fn pool_names_must_be_unique_and_plain() {
        assert_eq!(
            ray_violations(
                "    - name: a\n      roles: [reward]\n    - name: a\n      roles: [rollout]\n    \
                 - name: 'tpu pool'\n      roles: [rollout]\n    - name: ''\n      roles: [rollout]\n"
            ),
            vec![
                "r.yaml:12:7: `cluster.pools[1].name` = \"a\": is already the name of cluster.pools[0]; \
                 pool names must be unique",
                "r.yaml:14:7: `cluster.pools[2].name` = \"tpu pool\": must be a non-empty name of \
                 letters, digits, `-`, `_` and `.` (it goes on the workers' command line), e.g. \
                 `tpu-rollout`",
                "r.yaml:16:7: `cluster.pools[3].name` = \"\": must be a non-empty name of letters, \
                 digits, `-`, `_` and `.` (it goes on the workers' command line), e.g. `tpu-rollout`",
            ]
        );
    }

    #[test]
    fn pool_workers_and_roles_are_checked() {
        assert_eq!(
            ray_violations(
                "    - name: a\n      roles: []\n      workers: 0\n    - name: b\n      roles: [rollout, reward, rollout]\n"
            ),
            vec![
                "r.yaml:12:7: `cluster.pools[0].workers` = 0: must be at least 1 (workers per listed \
                 role); remove the pool to run none",
                "r.yaml:11:7: `cluster.pools[0].roles` = []: must list at least one of `rollout`, \
                 `reward`, `learner`",
                "r.yaml:14:7: `cluster.pools[1].roles` = [rollout, reward, rollout]: lists `rollout` \
                 twice; list each role once",
            ]
        );
    }

    #[test]
    fn at_most_one_learner_worker_over_all_pools() {
        assert_eq!(
            ray_violations("    - name: a\n      roles: [learner]\n      workers: 2\n"),
            vec![
                "r.yaml:12:7: `cluster.pools[0].workers` = 2: makes 2 learner workers over all pools; \
                 there is at most one (the learner is not replicated: list `learner` in one pool with \
                 `workers: 1`)"
            ]
        );
        assert_eq!(
            ray_violations(
                "    - name: a\n      roles: [learner]\n    - name: b\n      roles: [reward, learner]\n"
            ),
            vec![
                "r.yaml:13:7: `cluster.pools[1].roles` = [reward, learner]: makes 2 learner workers \
                 over all pools; there is at most one (the learner is not replicated: list `learner` \
                 in one pool with `workers: 1`)"
            ]
        );
    }

    #[test]
    fn pool_resources_must_not_be_negative() {
        assert_eq!(
            ray_violations(
                "    - name: a\n      roles: [rollout]\n      num_cpus: -1\n      num_gpus: -0.5\n      \
                 resources:\n        TPU: -4\n        GPU: 1\n"
            ),
            vec![
                "r.yaml:12:7: `cluster.pools[0].num_cpus` = -1: must be 0 or more",
                "r.yaml:13:7: `cluster.pools[0].num_gpus` = -0.5: must be 0 or more",
                "r.yaml:16:9: `cluster.pools[0].resources.GPU` = 1: Ray takes CPUs and GPUs from their \
                 own fields: use `cluster.pools[0].num_gpus` instead",
                "r.yaml:15:9: `cluster.pools[0].resources.TPU` = -4: must be 0 or more",
            ]
        );
        // In flow style the entry's line is named.
        assert_eq!(
            ray_violations("    - {name: a, roles: [rollout], resources: {CPU: 2}}\n"),
            vec![
                "r.yaml:10:5: `cluster.pools[0].resources.CPU` = 2: Ray takes CPUs and GPUs from \
                 their own fields: use `cluster.pools[0].num_cpus` instead"
            ]
        );
    }

    #[test]
    fn pool_values_set_by_an_override_blame_it() {
        let text = "model:\n  path: m\ndata:\n  train_files: t\n";
        let set = "cluster.pools=[{name: a, roles: [reward], workers: 0}]".to_string();
        let r = load_recipe_str(text, "r.yaml").unwrap();
        let r = super::super::apply_overrides(&r, std::slice::from_ref(&set), "r.yaml").unwrap();
        let v: Vec<String> = validate(&r, text, "r.yaml", std::slice::from_ref(&set))
            .iter()
            .map(|v| v.to_string())
            .collect();
        assert_eq!(
            v,
            vec![
                "--set cluster.pools=[{name: a, roles: [reward], workers: 0}]: `cluster.pools` = [a]: \
                 applies to `cluster.launcher: ray` only (the launcher is `local`, which starts \
                 `cluster.rollout_workers` / `reward_workers` / `learner_workers` on this host): set \
                 `cluster.launcher: ray` or remove the pools",
                "--set cluster.pools=[{name: a, roles: [reward], workers: 0}]: \
                 `cluster.pools[0].workers` = 0: must be at least 1 (workers per listed role); remove \
                 the pool to run none",
            ]
        );
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
            vec!["r.yaml:6:3: `actor.clip_ratio_low` = 1.5: must be in [0, 1)"]
        );
        let v = violations("rollout:\n  temperature: -0.5\n");
        assert_eq!(
            v,
            vec!["r.yaml:6:3: `rollout.temperature` = -0.5: must be 0 (greedy) or more"]
        );
        let v = violations("rollout:\n  top_p: 0\n");
        assert_eq!(v, vec!["r.yaml:6:3: `rollout.top_p` = 0: must be in (0, 1]"]);
        // min-p trims sampling: it has nothing to do under greedy decoding.
        let v = violations("rollout:\n  temperature: 0\n  min_p: 0.1\n");
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            v[0].contains("`rollout.min_p` = 0.1: trims what sampling draws from"),
            "{v:?}"
        );
        assert!(violations("rollout:\n  min_p: 0.1\n").is_empty());
        // Keys a mode does not read are refused in it (they would do nothing).
        let v = violations("actor:\n  clip_ratio_c: 10\n  policy_loss:\n    loss_mode: gspo\n");
        assert!(
            v[0].contains(
                "`actor.clip_ratio_c` = 10: is read only with actor.policy_loss.loss_mode: vanilla"
            ),
            "{v:?}"
        );
        let v = violations("actor:\n  clip_ratio_high: 0.28\n  policy_loss:\n    loss_mode: sapo\n");
        assert!(
            v[0].contains("`actor.clip_ratio_high` = 0.28: is read only with a loss that clips"),
            "{v:?}"
        );
        assert!(
            violations("actor:\n  clip_ratio_high: 0.28\n  policy_loss:\n    loss_mode: gspo\n").is_empty()
        );
        let v = violations("cluster:\n  device: cuda\n  cpu_device_count: 4\n");
        assert!(
            v.iter()
                .any(|v| v.contains("`cluster.cpu_device_count` = 4: sizes the CPU plugin's client")),
            "{v:?}"
        );
        let v = violations("rollout:\n  val_kwargs:\n    min_p: 0.1\n");
        assert!(v[0].contains("`rollout.val_kwargs.min_p` = 0.1"), "{v:?}");
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
    fn tensor_parallel_keys() {
        let tp = "actor:\n  strategy: fsdp\n  mesh: 4\n  tensor_model_parallel_size: 2\n  ppo_micro_batch_size: 2\nrollout:\n  tensor_model_parallel_size: 2\n";
        assert!(violations(tp).is_empty(), "{:?}", violations(tp));
        let layout = |extra: &str| {
            load_recipe_str(
                &format!("model:\n  path: m\ndata:\n  train_files: t.parquet\n{extra}"),
                "r.yaml",
            )
            .unwrap()
            .layout_text()
        };
        assert_eq!(
            layout(tp),
            "learner fsdp over 4 devices: data 2 x model 2; rollout in process on 4 device(s): 2 slot group(s) \
             x model 2, 32 slots each"
        );
        assert_eq!(
            layout("rollout:\n  tensor_model_parallel_size: 2\ncluster:\n  rollout_workers: 1\n"),
            "learner on 1 device; rollout per worker on 2 device(s): 1 slot group(s) x model 2, 64 slots each"
        );
        assert_eq!(
            violations("actor:\n  strategy: fsdp\n  mesh: 4\n  tensor_model_parallel_size: 3\n"),
            vec![
                "r.yaml:7:3: `actor.mesh` = 4: must be a multiple of actor.tensor_model_parallel_size (3): \
                 the learner's mesh is data x model devices, 3 on the model axis"
            ]
        );
        assert_eq!(
            violations("actor:\n  strategy: dp\n  mesh: 4\n  tensor_model_parallel_size: 2\n  ppo_micro_batch_size: 1\n"),
            vec![
                "r.yaml:9:3: `actor.ppo_micro_batch_size` = 1: must divide by 2, the data axis of \
                 actor.mesh (4) / actor.tensor_model_parallel_size (2): actor.strategy dp splits each \
                 micro-batch's rows evenly over the data axis"
            ]
        );
        let single = violations("actor:\n  tensor_model_parallel_size: 2\n");
        assert!(single[0].contains("actor.strategy single uses one"), "{single:?}");
        let one_device = violations("rollout:\n  tensor_model_parallel_size: 2\n");
        assert!(
            one_device[0].contains("but the learner uses one"),
            "{one_device:?}"
        );
        // Rollout workers run their engines on their own 2 devices.
        assert!(
            violations("rollout:\n  tensor_model_parallel_size: 2\ncluster:\n  rollout_workers: 1\n")
                .is_empty()
        );
        let groups = violations(
            "actor:\n  strategy: dp\n  mesh: 4\nrollout:\n  tensor_model_parallel_size: 2\n  max_num_seqs: 3\n",
        );
        assert!(
            groups[0].contains("must divide by the 2 slot groups of the rollout's 4 devices (2 tensor-parallel devices each)"),
            "{groups:?}"
        );
        let nest = violations(
            "actor:\n  strategy: fsdp\n  mesh: 6\n  tensor_model_parallel_size: 2\n  ppo_micro_batch_size: 3\nrollout:\n  n: 3\n  tensor_model_parallel_size: 3\n  max_num_seqs: 6\n",
        );
        assert_eq!(nest.len(), 1, "{nest:?}");
        assert!(
            nest[0].contains("must divide or be a multiple of actor.tensor_model_parallel_size (2)"),
            "{nest:?}"
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
                 actor.strategy dp splits each micro-batch's rows evenly over the devices",
                "`rollout.max_num_seqs` = 64: must divide by actor.mesh (3): the in-process rollout \
                 runs on the learner's 3 devices and splits its KV-cache slots evenly over them"
            ]
        );
        let six_slots = "actor:\n  strategy: fsdp\n  mesh: 4\nrollout:\n  max_num_seqs: 6\n";
        assert_eq!(
            violations(six_slots),
            vec![
                "r.yaml:9:3: `rollout.max_num_seqs` = 6: must divide by actor.mesh (4): the in-process \
                 rollout runs on the learner's 4 devices and splits its KV-cache slots evenly over them"
            ]
        );
        // With rollout workers the slots are theirs, on their own devices.
        assert_eq!(
            violations(&format!("{six_slots}cluster:\n  rollout_workers: 1\n")),
            Vec::<String>::new()
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
