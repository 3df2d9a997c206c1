//! A generative judge (`reward.scorers.NAME: {kind: judge, ...}`): a chat model asked to grade
//! each response with the recipe's instruction, at temperature 0, so a response always gets the
//! same reward. `verdict: probability` reads the judge's first answer token: the reward is
//! `P(yes) / (P(yes) + P(no))`, computed in one forward pass by the judge's output head
//! restricted to those two tokens ([`ClassifierWeights::from_lm_head`]). `verdict: parse` lets
//! the judge answer greedily on a rollout engine and parses a number out of the answer.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use model::classifier::ClassifierWeights;
use model::programs::ModelText;
use model::{ChatMessage, ChatTemplate, ModelWeights};
use reward::{JudgeSpec, ModelScorerError, Sample, Score, ScoreError, Scorer, Verdict};
use rollout::{Engine, EngineConfig, EngineControl, EngineOutput, GenerationRequest, SamplingParams};
use serde_json::json;
use xla::DType;

use super::{compute_dtype, model_error, prompt_messages, ClassifierThread};
use crate::recipe::Recipe;

pub(super) struct JudgeScorer {
    name: String,
    path: PathBuf,
    /// The judge's config, tokenizer and chat template (its weights are read when its device
    /// starts).
    text: ModelText,
    template: ChatTemplate,
    instruction: minijinja::Environment<'static>,
    system: Option<String>,
    how: How,
    max_length: usize,
    micro_batch_size: usize,
    dtype: DType,
    recipe: Recipe,
    /// The judge on its device, once started (or why it could not start).
    device: OnceLock<Result<Device, String>>,
}

/// The verdict, resolved against the judge's tokenizer.
enum How {
    /// The token ids of `yes` and `no`.
    Probability([u32; 2]),
    Parse {
        pattern: regex::Regex,
        max_new_tokens: usize,
        scale: f64,
    },
}

enum Device {
    Probability(ClassifierThread),
    Parse(Generator),
}

impl JudgeScorer {
    /// Reads the judge's config, tokenizer and chat template, checks the instruction
    /// template and the verdict against it; with `load_now` puts it on its device now.
    pub(super) fn open(
        name: &str,
        spec: &JudgeSpec,
        recipe: &Recipe,
        load_now: bool,
    ) -> Result<JudgeScorer, ModelScorerError> {
        let path = PathBuf::from(&spec.path);
        let text = ModelText::load(&path).map_err(|e| ModelScorerError::new("path", e.to_string()))?;
        let template = text.chat_template.clone().ok_or_else(|| {
            ModelScorerError::new(
                "path",
                format!(
                    "{} has no chat template (tokenizer_config.json's `chat_template`, or the GGUF's \
                     `tokenizer.chat_template`): a judge is a chat model",
                    path.display()
                ),
            )
        })?;
        let mut instruction = minijinja::Environment::new();
        instruction.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
        instruction
            .add_template_owned("instruction", spec.instruction.clone())
            .map_err(|e| {
                ModelScorerError::new("instruction", format!("is not a valid Jinja template: {e}"))
            })?;
        let how = match &spec.verdict {
            Verdict::Probability { yes, no } => {
                let token = |field: &str, answer: &str| match text.tokenizer.encode(answer, false).as_deref()
                {
                    Ok([id]) => Ok(*id),
                    Ok(ids) => Err(ModelScorerError::new(
                        &format!("verdict.{field}"),
                        format!(
                            "{answer:?} is {} tokens in the judge's tokenizer; the verdict is read from one \
                             token: give an answer that is a single token (often without a leading space)",
                            ids.len()
                        ),
                    )),
                    Err(e) => Err(ModelScorerError::new(&format!("verdict.{field}"), e.to_string())),
                };
                How::Probability([token("yes", yes)?, token("no", no)?])
            }
            Verdict::Parse {
                pattern,
                max_new_tokens,
                scale,
            } => How::Parse {
                pattern: regex::Regex::new(pattern)
                    .map_err(|e| ModelScorerError::new("verdict.pattern", e.to_string()))?,
                max_new_tokens: *max_new_tokens,
                scale: *scale,
            },
        };
        let scorer = JudgeScorer {
            name: name.to_string(),
            path,
            text,
            template,
            instruction,
            system: spec.system.clone(),
            how,
            max_length: spec.max_length,
            micro_batch_size: spec.micro_batch_size,
            dtype: compute_dtype(spec.dtype, recipe),
            recipe: recipe.clone(),
            device: OnceLock::new(),
        };
        let check = sample_for_check();
        scorer
            .judge_text(&check)
            .map_err(|e| ModelScorerError::new("instruction", format!("does not render: {e}")))?;
        if load_now {
            scorer.device().map_err(|e| ModelScorerError::new("path", e))?;
        }
        Ok(scorer)
    }

    /// The judge on its device, started the first time.
    fn device(&self) -> Result<&Device, String> {
        self.device
            .get_or_init(|| {
                let at = |e: String| format!("judge {}: {e}", self.path.display());
                let weights = self.text.load_weights().map_err(|e| at(e.to_string()))?;
                match &self.how {
                    How::Probability(tokens) => {
                        let classifier = ClassifierWeights::from_lm_head(weights, tokens)
                            .map_err(|e| at(e.to_string()))?;
                        ClassifierThread::start(
                            &self.name,
                            classifier,
                            &self.recipe,
                            self.dtype,
                            self.micro_batch_size,
                        )
                        .map(Device::Probability)
                        .map_err(at)
                    }
                    How::Parse { max_new_tokens, .. } => self
                        .generator(weights, *max_new_tokens)
                        .map(Device::Parse)
                        .map_err(at),
                }
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    fn generator(&self, weights: ModelWeights, max_new_tokens: usize) -> Result<Generator, String> {
        let client = crate::setup::device::open_client(&self.recipe).map_err(|e| e.to_string())?;
        let buffers = rollout::upload_weights(&client, &weights, self.dtype, 0).map_err(|e| e.to_string())?;
        let mut settings = EngineConfig::new(self.micro_batch_size, self.max_length + max_new_tokens);
        settings.eos_token_ids = self.text.stop_tokens();
        let engine = Engine::new(
            &client,
            &weights.config,
            buffers,
            0,
            settings,
            Some(self.text.tokenizer.clone()),
        )
        .map_err(|e| e.to_string())?
        .spawn();
        drop(weights);
        tracing::info!(
            "judge `{}` on {} in {}",
            self.name,
            client.platform_name(),
            self.dtype
        );
        Ok(Generator::start(&self.name, engine, max_new_tokens))
    }

    /// The judge's prompt for `sample`: the instruction rendered over the sample, as the user's
    /// message after the system message, rendered by the judge's chat template with the
    /// assistant's turn opened.
    fn judge_prompt(&self, sample: &Sample) -> Result<Vec<u32>, String> {
        let text = self.judge_text(sample)?;
        let ids = self
            .text
            .tokenizer
            .encode(&text, false)
            .map_err(|e| e.to_string())?;
        if ids.len() > self.max_length {
            return Err(format!(
                "the judge's prompt is {} tokens, over `max_length` {}",
                ids.len(),
                self.max_length
            ));
        }
        Ok(ids)
    }

    /// [`JudgeScorer::judge_prompt`] as text.
    fn judge_text(&self, sample: &Sample) -> Result<String, String> {
        let messages = prompt_messages(&sample.prompt)?;
        let question = messages
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map(|m| m.content.clone())
            .unwrap_or_default();
        let context = json!({
            "prompt": question,
            "messages": messages.iter().map(|m| json!({"role": m.role, "content": m.content})).collect::<Vec<_>>(),
            "response": sample.response,
            "ground_truth": sample.ground_truth,
            "extra": sample.extra,
        });
        let user = self
            .instruction
            .get_template("instruction")
            .and_then(|t| t.render(&context))
            .map_err(|e| format!("the instruction does not render: {e}"))?;
        let mut chat = Vec::with_capacity(2);
        if let Some(system) = &self.system {
            chat.push(ChatMessage::new("system", system.clone()));
        }
        chat.push(ChatMessage::new("user", user));
        self.template.render(&chat, true).map_err(|e| e.to_string())
    }
}

/// A sample with every field the instruction may read, to check it renders at start.
fn sample_for_check() -> Sample {
    Sample {
        id: 0,
        data_source: String::new(),
        prompt: json!([{"role": "user", "content": "?"}]),
        response: String::new(),
        ground_truth: String::new(),
        extra: json!({}),
        response_length: 0,
        truncated: false,
    }
}

impl Scorer for JudgeScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let failed = model_error(&self.name, sample);
        let ids = self.judge_prompt(sample).map_err(failed)?;
        match (self.device().map_err(failed)?, &self.how) {
            (Device::Probability(classifier), _) => {
                let logits = classifier.score(ids).map_err(failed)?;
                let p_yes = 1.0 / (1.0 + (logits[1] as f64 - logits[0] as f64).exp());
                Ok(Score::new(p_yes))
            }
            (Device::Parse(generator), How::Parse { pattern, scale, .. }) => {
                let answer = generator.generate(ids).map_err(failed)?;
                let number = pattern
                    .captures_iter(&answer)
                    .last()
                    .and_then(|c| c.get(1))
                    .ok_or_else(|| {
                        let start: String = answer.chars().take(300).collect();
                        failed(format!(
                            "the judge's answer has no match of `{pattern}`: {start:?}"
                        ))
                    })?;
                let value: f64 = number.as_str().trim().parse().map_err(|_| {
                    failed(format!(
                        "`{}` in the judge's answer is not a number",
                        number.as_str()
                    ))
                })?;
                Ok(Score::new(value * scale))
            }
            (Device::Parse(_), How::Probability(_)) => unreachable!("the device follows the verdict"),
        }
    }
}

type Waiting = Mutex<HashMap<u64, mpsc::Sender<Result<String, String>>>>;

/// A rollout engine answering judge prompts greedily; a thread hands each answer to the call
/// waiting for it and stops the engine once the scorer is gone.
struct Generator {
    control: Mutex<EngineControl>,
    waiting: Arc<Waiting>,
    next_id: AtomicU64,
    max_new_tokens: usize,
}

impl Generator {
    fn start(name: &str, engine: rollout::EngineHandle, max_new_tokens: usize) -> Generator {
        let waiting: Arc<Waiting> = Arc::default();
        let weak: Weak<Waiting> = Arc::downgrade(&waiting);
        let control = Mutex::new(engine.control());
        let spawned = std::thread::Builder::new()
            .name(format!("judge-{name}"))
            .spawn(move || loop {
                let output = match engine.outputs().recv_timeout(Duration::from_millis(200)) {
                    Ok(output) => output,
                    Err(mpsc::RecvTimeoutError::Timeout) if weak.strong_count() > 0 => continue,
                    Err(_) => {
                        let _ = engine.shutdown();
                        return;
                    }
                };
                let Some(waiting) = weak.upgrade() else { continue };
                let (id, answer) = match output {
                    EngineOutput::Sample(s) => (s.request_id, Ok(s.text)),
                    EngineOutput::Rejected(rollout::RolloutError::Rejected { request_id, problem }) => {
                        (request_id, Err(problem))
                    }
                    EngineOutput::Rejected(e) => {
                        // The engine failed: every waiting call gets the error.
                        for (_, reply) in waiting.lock().unwrap_or_else(|e| e.into_inner()).drain() {
                            let _ = reply.send(Err(e.to_string()));
                        }
                        continue;
                    }
                };
                let reply = waiting.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                if let Some(reply) = reply {
                    let _ = reply.send(answer);
                }
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start the judge's answer thread: {e}");
        }
        Generator {
            control,
            waiting,
            next_id: AtomicU64::new(0),
            max_new_tokens,
        }
    }

    /// The judge's greedy answer to `prompt`.
    fn generate(&self, prompt: Vec<u32>) -> Result<String, String> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = mpsc::channel();
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, reply);
        let request = GenerationRequest {
            id,
            prompt,
            n: 1,
            seed: 0,
            params: SamplingParams {
                temperature: 0.0,
                max_new_tokens: self.max_new_tokens,
                ..SamplingParams::default()
            },
            multi_turn: None,
        };
        let submitted = self
            .control
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .submit(request);
        if let Err(e) = submitted {
            self.waiting.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            return Err(e.to_string());
        }
        answer
            .recv()
            .map_err(|_| "the judge's engine has stopped".to_string())?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::programs::{generate, DeviceModel, FullLogitsProgram, GenerateOptions, HostModel};
    use reward::ModelDType;

    fn recipe() -> Recipe {
        crate::recipe::load_recipe_str(
            "model:\n  path: m.gguf\ndata:\n  train_files: t.parquet\n",
            "r.yaml",
        )
        .unwrap()
    }

    fn spec(instruction: &str, verdict: Verdict) -> JudgeSpec {
        JudgeSpec {
            path: testkit::smollm2_gguf().display().to_string(),
            instruction: instruction.into(),
            system: Some("You grade answers.".into()),
            verdict,
            max_length: 256,
            micro_batch_size: 4,
            dtype: ModelDType::F32,
        }
    }

    /// Questions with a right and a wrong answer each.
    fn samples() -> Vec<Sample> {
        [
            ("What is the capital of France?", "Paris", "Paris"),
            ("What is the capital of France?", "Berlin", "Paris"),
            ("What is 2 + 2?", "4", "4"),
            ("What is 2 + 2?", "The answer is 5.", "4"),
        ]
        .iter()
        .enumerate()
        .map(|(i, (q, a, truth))| Sample {
            id: i as u64,
            data_source: "test".into(),
            prompt: json!([{"role": "user", "content": q}]),
            response: a.to_string(),
            ground_truth: truth.to_string(),
            extra: json!({}),
            response_length: 1,
            truncated: false,
        })
        .collect()
    }

    fn yes_no() -> Verdict {
        Verdict::Probability {
            yes: "Yes".into(),
            no: "No".into(),
        }
    }

    const GRADE: &str =
        "Question: {{ prompt }}\nAnswer: {{ response }}\nIs the answer correct? Reply Yes or No.";

    /// At temperature 0 the same responses get the same rewards, from one scorer or another,
    /// batched or one at a time; each is the judge's own next-token odds of "Yes" against "No"
    /// after its prompt, computed here from the full logits.
    #[test]
    fn probability_verdicts_are_deterministic_and_the_judge_s_odds() {
        let recipe = recipe();
        let verdict = yes_no();
        let a = JudgeScorer::open("judge", &spec(GRADE, verdict.clone()), &recipe, true).unwrap();
        let samples = samples();
        let together: Vec<f64> = std::thread::scope(|s| {
            let handles: Vec<_> = samples
                .iter()
                .map(|x| s.spawn(|| a.score(x).unwrap().value))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let b = JudgeScorer::open("judge", &spec(GRADE, verdict), &recipe, false).unwrap();
        let one_by_one: Vec<f64> = samples.iter().map(|x| b.score(x).unwrap().value).collect();
        let again: Vec<f64> = samples.iter().map(|x| a.score(x).unwrap().value).collect();
        assert_eq!(one_by_one, again, "the same inputs, the same rewards");
        let host = HostModel::load(&testkit::smollm2_gguf()).unwrap();
        let device = DeviceModel::upload(testkit::cpu_client(1), &host.weights, DType::F32, 0).unwrap();
        let [yes, no] = [
            host.tokenizer.encode("Yes", false).unwrap()[0],
            host.tokenizer.encode("No", false).unwrap()[0],
        ];
        for ((x, got), batched) in samples.iter().zip(&one_by_one).zip(&together) {
            let ids = a.judge_prompt(x).unwrap();
            let logits = FullLogitsProgram::compile(&device, 1, ids.len())
                .unwrap()
                .run(&device, &ids, &vec![1; ids.len()])
                .unwrap();
            let vocab = host.weights.config.vocab_size;
            let last = &logits[(ids.len() - 1) * vocab..];
            let expected = 1.0 / (1.0 + ((last[no as usize] - last[yes as usize]) as f64).exp());
            assert!(
                (got - expected).abs() < 1e-5,
                "{:?}: {got} vs {expected}",
                x.response
            );
            assert!(
                (got - batched).abs() < 1e-5,
                "{:?}: {got} alone vs {batched} batched",
                x.response
            );
        }
        println!(
            "P(Yes) of {:?}: {one_by_one:?}",
            samples.iter().map(|s| &s.response).collect::<Vec<_>>()
        );
    }

    /// `parse`: the reward is the number in the judge's greedy answer, the answer being the one
    /// the model's own greedy generation gives; an answer without the pattern is an error.
    #[test]
    fn parse_verdicts_read_the_greedy_answer() {
        let recipe = recipe();
        let instruction = "Question: {{ prompt }}\nAnswer: {{ response }}\nRate the answer from 0 to 10. Reply with 'Score: N' and nothing else.";
        let verdict = Verdict::Parse {
            pattern: r"(\d+)".into(),
            max_new_tokens: 12,
            scale: 0.1,
        };
        let judge = JudgeScorer::open("judge", &spec(instruction, verdict), &recipe, true).unwrap();
        let host = HostModel::load(&testkit::smollm2_gguf()).unwrap();
        let device = DeviceModel::upload(testkit::cpu_client(1), &host.weights, DType::F32, 0).unwrap();
        let options = GenerateOptions {
            max_new_tokens: 12,
            temperature: 0.0,
            seed: 0,
            stop_tokens: host.stop_tokens(),
        };
        let pattern = regex::Regex::new(r"(\d+)").unwrap();
        let samples = samples();
        let first: Vec<Result<f64, String>> = samples
            .iter()
            .map(|x| judge.score(x).map(|s| s.value).map_err(|e| e.to_string()))
            .collect();
        for (x, got) in samples.iter().zip(&first) {
            let ids = judge.judge_prompt(x).unwrap();
            let answer = host
                .tokenizer
                .decode(&generate(&device, &ids, &options).unwrap(), true)
                .unwrap();
            let expected = pattern
                .captures_iter(&answer)
                .last()
                .map(|c| c[1].parse::<f64>().unwrap() * 0.1);
            match (got, expected) {
                (Ok(v), Some(e)) => assert!((v - e).abs() < 1e-12, "{answer:?}: {v} vs {e}"),
                (Err(message), None) => assert!(message.contains("has no match of `(\\d+)`"), "{message}"),
                other => panic!("{:?} answered {answer:?}: {other:?}", x.response),
            }
            println!("{:?} -> {answer:?} -> {got:?}", x.response);
        }
        let again: Vec<Result<f64, String>> = samples
            .iter()
            .map(|x| judge.score(x).map(|s| s.value).map_err(|e| e.to_string()))
            .collect();
        assert_eq!(first, again);
    }

    #[test]
    fn bad_instructions_and_verdicts_are_named() {
        let recipe = recipe();
        let probability = yes_no();
        let open = |instruction: &str, verdict: Verdict| {
            JudgeScorer::open("judge", &spec(instruction, verdict), &recipe, false)
                .err()
                .unwrap()
        };
        let e = open("{{ respons }}", probability.clone());
        assert_eq!(e.field, "instruction");
        assert!(
            e.message.contains("does not render") && e.message.contains("undefined"),
            "{}",
            e.message
        );
        let e = open("{% if %}", probability);
        assert_eq!(
            (
                e.field.as_str(),
                e.message.starts_with("is not a valid Jinja template")
            ),
            ("instruction", true),
            "{}",
            e.message
        );
        let e = open(
            GRADE,
            Verdict::Probability {
                yes: "Absolutely yes".into(),
                no: "No".into(),
            },
        );
        assert_eq!(e.field, "verdict.yes");
        assert!(
            e.message.contains("is 2 tokens in the judge's tokenizer")
                || e.message.contains("tokens in the judge's tokenizer"),
            "{}",
            e.message
        );
        let e = JudgeScorer::open(
            "judge",
            &JudgeSpec {
                path: "/nowhere/judge".into(),
                ..spec(GRADE, yes_no())
            },
            &recipe,
            false,
        )
        .err()
        .unwrap();
        assert_eq!(e.field, "path");
        // A prompt longer than max_length scores 0 with a counted error, not a crash.
        let judge = JudgeScorer::open(
            "judge",
            &JudgeSpec {
                max_length: 8,
                ..spec(GRADE, yes_no())
            },
            &recipe,
            false,
        )
        .unwrap();
        let e = judge.score(&samples()[0]).unwrap_err();
        assert_eq!(e.kind(), "model");
        assert!(e.to_string().contains("over `max_length` 8"), "{e}");
    }
}
