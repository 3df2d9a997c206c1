//! Multi-turn samples in the engine on a tiny random model through the CPU plugin: turns park
//! at a stop token with their KV cache kept, the environment's tokens are written into that
//! cache, and the next turn's log-probs equal the `logprobs` program's over the whole sequence;
//! budgets, stale answers after a weight update, and the streaming handle's environment.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{episode, of_request, request, sampled};
use model::programs::{DeviceModel, LogprobsProgram};
use model::{random_init, ModelConfig, ModelWeights};
use rollout::{
    upload_weights, Engine, EngineConfig, EngineOutput, Episode, FinishReason, GenerationRequest, Resume,
    Resumer, Sample, Turn, TurnHandler,
};
use testkit::client;
use xla::DType;

const MAX_LEN: usize = 48;

fn engine(weights: &ModelWeights, slots: usize) -> Engine {
    chunked_engine(weights, slots, 0)
}

/// An engine whose cache is split into chunks of `kv_chunk` positions (0: one chunk).
fn chunked_engine(weights: &ModelWeights, slots: usize, kv_chunk: usize) -> Engine {
    let buffers = upload_weights(client(), weights, DType::F32, 0).unwrap();
    let mut settings = EngineConfig::new(slots, MAX_LEN);
    settings.kv_chunk = kv_chunk;
    Engine::new(client(), &weights.config, buffers, 1, settings, None).unwrap()
}

/// The environment of most tests here: 3 tokens after each turn, `turns` turns.
fn answer(turn: &Turn, turns: u32) -> Resume {
    common::answer(turn, turns, 3)
}

fn run_episodes(engine: &mut Engine, requests: &[GenerationRequest], turns: u32) -> Vec<Sample> {
    common::run_episodes(engine, requests, |t| answer(t, turns))
}

/// The largest gap between a sample's model-token log-probs and the `logprobs` program's over
/// its whole sequence; environment tokens must carry 0.
fn largest_model_token_gap(weights: &ModelWeights, samples: &[Sample]) -> f32 {
    let dm = DeviceModel::upload(client(), weights, DType::F32, 0).unwrap();
    let program = LogprobsProgram::compile(&dm, 1, MAX_LEN).unwrap();
    let mut worst = 0f32;
    for s in samples {
        let mut tokens = s.prompt_ids.clone();
        tokens.extend(&s.response_ids);
        let real = tokens.len();
        let mask: Vec<i32> = (0..MAX_LEN).map(|i| (i < real) as i32).collect();
        tokens.resize(MAX_LEN, 0);
        let (lp, _) = program.run(&dm, &tokens, &mask, 1.0).unwrap();
        for (j, model) in s.model_token_mask().into_iter().enumerate() {
            if model {
                worst = worst.max((s.logprobs[j] - lp[s.prompt_ids.len() + j]).abs());
            } else {
                assert_eq!(s.logprobs[j], 0.0);
            }
        }
    }
    worst
}

#[test]
fn turns_continue_in_their_cache_and_match_the_logprobs_program() {
    let weights = random_init(&ModelConfig::tiny_llama(), 21);
    let requests = [
        episode(1, &[4, 8, 15, 16], 3, 40, 12),
        episode(2, &[9, 5], 2, 40, 12),
        request(3, &[7, 7, 7], 1, 3, sampled(1.0, 0, 1.0, 20)),
    ];
    let mut e = engine(&weights, 8);
    let samples = run_episodes(&mut e, &requests, 3);
    assert_eq!(samples.len(), 6);
    assert_eq!(
        e.stats().prefill_runs,
        3,
        "earlier turns are never prefilled again"
    );

    let multi: Vec<&Sample> = samples.iter().filter(|s| s.request_id != 3).collect();
    let mut continued = 0;
    for s in &multi {
        let turns = s.env_spans.len() as u32 + 1;
        assert_eq!(
            s.episode.turns, turns,
            "request {} sample {}",
            s.request_id, s.sample_index
        );
        // One answer per parked turn: each continued one, and the last when it parked too.
        let answered = s.episode.tool_calls as usize;
        assert!((s.env_spans.len()..=s.env_spans.len() + 1).contains(&answered));
        for (k, span) in s.env_spans.iter().enumerate() {
            assert_eq!(s.response_ids[span.clone()], [21 + k as u32, 9, 30]);
            assert!(
                (0..4).contains(&s.response_ids[span.start - 1]),
                "a turn ends at its stop token"
            );
        }
        continued += s.env_spans.len();
    }
    assert!(
        continued >= 4,
        "too few turns continued ({continued}) to test anything"
    );
    // One extend run per continued turn writes the model's last token and the environment's
    // first two; the third is the next decode row's input.
    assert_eq!(e.stats().extend_runs, continued);
    assert_eq!(e.stats().env_tokens, 3 * continued);
    let single = of_request(&samples, 3)[0];
    assert!(single.env_spans.is_empty());
    assert_eq!(single.episode.turns, 1);

    let worst = largest_model_token_gap(&weights, &samples);
    assert!(
        worst < 1e-5,
        "engine vs logprobs program over multi-turn samples: {worst}"
    );

    // The same episodes in a smaller engine, each request alone: the same tokens and bits.
    let mut alone = Vec::new();
    for r in &requests {
        alone.extend(run_episodes(&mut engine(&weights, 4), std::slice::from_ref(r), 3));
    }
    common::assert_identical(&alone, &samples, "alone vs together");
}

#[test]
fn long_environment_answers_are_prefilled_across_cache_chunks() {
    let weights = random_init(&ModelConfig::tiny_llama(), 26);
    // 13 environment tokens a turn: 13 positions written by a 16-token extend run (3 rows of
    // padding), so each answer spans two or three of the cache's 8-position chunks.
    let requests = [episode(1, &[4, 8, 15, 16], 4, 44, 6), episode(2, &[9], 2, 44, 6)];
    let mut e = chunked_engine(&weights, 8, 8);
    let samples = common::run_episodes(&mut e, &requests, |t| common::answer(t, 3, 13));
    let continued: usize = samples.iter().map(|s| s.env_spans.len()).sum();
    assert!(
        continued >= 4,
        "too few turns continued ({continued}) to test anything"
    );
    for s in &samples {
        assert!(s.env_spans.iter().all(|span| span.len() == 13));
    }
    assert_eq!(e.stats().extend_runs, continued);
    let worst = largest_model_token_gap(&weights, &samples);
    assert!(
        worst < 1e-5,
        "engine vs logprobs program after long answers: {worst}"
    );
    // The same episodes over an unchunked cache: the same tokens.
    let whole = common::run_episodes(&mut engine(&weights, 8), &requests, |t| common::answer(t, 3, 13));
    for (a, b) in whole.iter().zip(&samples) {
        assert_eq!(a.response_ids, b.response_ids);
    }
}

#[test]
fn budgets_end_episodes_truncated() {
    let weights = random_init(&ModelConfig::tiny_llama(), 22);
    // Turns of at most 2 tokens: most turns hit the limit before a stop token.
    let mut e = engine(&weights, 4);
    let samples = run_episodes(&mut e, &[episode(1, &[4, 8], 4, 40, 2)], 5);
    assert!(samples
        .iter()
        .any(|s| s.finish_reason == FinishReason::MaxTurnTokens));
    for s in &samples {
        if s.finish_reason == FinishReason::MaxTurnTokens {
            assert!(s.finish_reason.is_truncated());
            let last_turn = s.env_spans.last().map_or(0, |r| r.end);
            assert_eq!(s.response_ids.len() - last_turn, 2);
        }
    }
    // A response budget the environment's tokens would overflow ends the sample without them.
    let mut e = engine(&weights, 4);
    let samples = run_episodes(&mut e, &[episode(2, &[4, 8], 4, 6, 40)], 5);
    for s in &samples {
        assert!(s.response_ids.len() < 6 || s.finish_reason == FinishReason::MaxNewTokens);
        if s.finish_reason == FinishReason::MaxNewTokens {
            assert!(s.response_ids.len() <= 6);
        }
    }
    assert!(
        samples
            .iter()
            .any(|s| s.finish_reason == FinishReason::MaxNewTokens && s.response_ids.len() < 6),
        "some sample must stop because the environment's tokens did not fit: {:?}",
        samples
            .iter()
            .map(|s| (&s.response_ids, &s.finish_reason))
            .collect::<Vec<_>>()
    );
}

#[test]
fn a_weight_update_restarts_episodes_and_drops_stale_answers() {
    let weights = random_init(&ModelConfig::tiny_llama(), 23);
    let request = episode(1, &[4, 8, 15], 4, 40, 30);
    let mut e = engine(&weights, 4);
    e.submit(request.clone()).unwrap();
    let (mut parked, mut samples) = (Vec::new(), Vec::new());
    while parked.is_empty() && e.has_work() {
        samples.extend(e.step().unwrap());
        parked = e.take_turns();
    }
    assert!(!parked.is_empty(), "no turn parked: {samples:?}");
    let restarted = 4 - samples.len();
    let w2 = random_init(&ModelConfig::tiny_llama(), 24);
    assert!(e.take_abandoned().is_empty());
    e.update_weights(2, upload_weights(client(), &w2, DType::F32, 0).unwrap())
        .unwrap();
    // Every run in flight is abandoned, parked or not; its environment is told.
    let abandoned = e.take_abandoned();
    assert_eq!(abandoned.len(), restarted);
    assert!(parked.iter().all(|t| abandoned.contains(&t.id)));
    for turn in &parked {
        assert!(
            !e.resume(turn.id, answer(turn, 2)).unwrap(),
            "stale answers are dropped"
        );
    }
    while e.has_work() || e.parked_samples() > 0 {
        samples.extend(e.step().unwrap());
        for turn in e.take_turns() {
            assert_eq!(turn.id.restarts, 1);
            e.resume(turn.id, answer(&turn, 2)).unwrap();
        }
    }
    samples.sort_by_key(|s| s.sample_index);
    let fresh = run_episodes(&mut engine(&w2, 4), &[request], 2);
    assert_eq!(samples.len(), 4);
    let again: Vec<_> = samples.iter().filter(|s| s.weight_version == 2).collect();
    assert_eq!(again.len(), restarted);
    for s in again {
        assert_eq!(s.restarts, 1);
        let f = &fresh[s.sample_index];
        assert_eq!(
            s.response_ids, f.response_ids,
            "a restarted episode is a fresh one"
        );
        assert_eq!(s.env_spans, f.env_spans);
    }
}

/// Answers each turn from another thread after a short wait, as a tool would.
struct SlowEnvironment;

impl TurnHandler for SlowEnvironment {
    fn on_turn(&self, turn: Turn, resumer: Resumer) {
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            resumer.resume(turn.id, answer(&turn, 2));
        });
    }
}

#[test]
fn the_streaming_handle_runs_episodes_through_its_environment() {
    let weights = random_init(&ModelConfig::tiny_llama(), 25);
    let requests = [episode(1, &[4, 8, 15], 3, 40, 12), episode(2, &[3], 2, 40, 12)];
    let expected = run_episodes(&mut engine(&weights, 8), &requests, 2);

    let without = engine(&weights, 8).spawn();
    without.submit(requests[0].clone()).unwrap();
    match without.outputs().recv_timeout(Duration::from_secs(60)).unwrap() {
        EngineOutput::Rejected(e) => assert!(e.to_string().contains("needs an environment"), "{e}"),
        EngineOutput::Sample(s) => panic!("served without an environment: {s:?}"),
    }

    let handle = engine(&weights, 8).spawn_with(Some(Arc::new(SlowEnvironment)));
    handle.control().submit_all(requests.to_vec()).unwrap();
    let mut got = Vec::new();
    while got.len() < expected.len() {
        match handle.outputs().recv_timeout(Duration::from_secs(60)).unwrap() {
            EngineOutput::Sample(s) => got.push(s),
            EngineOutput::Rejected(e) => panic!("{e}"),
        }
    }
    got.sort_by_key(|s| (s.request_id, s.sample_index));
    common::assert_identical(&got, &expected, "through the handle");
    assert!(!handle.shutdown().unwrap().has_work());
}

mod tools {
    use super::*;
    use agent::{Calculator, CallFormat, Tool, ToolError, ToolSchema, Toolbox};
    use model::programs::HostModel;
    use model::{ChatMessage, ModelTokenizer};
    use rollout::environment::{ToolEnvironment, ToolSettings, TruncateSide};
    use rollout::TurnId;
    use serde_json::{json, Value};

    /// A tool that misbehaves as its argument says: sleeps, panics or floods.
    struct Unruly;

    impl Tool for Unruly {
        fn schema(&self) -> ToolSchema {
            ToolSchema {
                name: "unruly".into(),
                description: "misbehaves".into(),
                parameters: json!({"type": "object", "properties": {"how": {"type": "string"}}}),
            }
        }

        fn call(&self, arguments: &Value) -> Result<String, ToolError> {
            match arguments["how"].as_str() {
                Some("hang") => {
                    std::thread::sleep(Duration::from_secs(30));
                    Ok("late".into())
                }
                Some("panic") => panic!("the tool broke"),
                Some("flood") => Ok("x".repeat(3 << 20)),
                _ => Ok("\u{0}\u{7}garbage\u{fffd}".into()),
            }
        }
    }

    fn smollm2() -> (ModelTokenizer, model::ChatTemplate) {
        let host = HostModel::load(&testkit::smollm2_gguf()).unwrap();
        (host.tokenizer, host.chat_template.unwrap())
    }

    fn environment(max_assistant_turns: u32) -> ToolEnvironment {
        let (tokenizer, template) = smollm2();
        let toolbox = Toolbox::new([Arc::new(Calculator) as Arc<dyn Tool>, Arc::new(Unruly)]).unwrap();
        let settings = ToolSettings {
            format: CallFormat::Hermes,
            max_assistant_turns,
            max_parallel_calls: 2,
            max_user_turns: 0,
            max_tool_response_length: 64,
            truncate_side: TruncateSide::Middle,
            tool_timeout: Duration::from_millis(300),
        };
        ToolEnvironment::new(toolbox, settings, template, tokenizer)
    }

    /// A parked first turn of `text` (its `<|im_end|>` appended) after the prompt `prompt`.
    fn turn(tokenizer: &ModelTokenizer, prompt: &[u32], text: &str, turns: u32) -> Turn {
        let response = tokenizer.encode(&format!("{text}<|im_end|>"), false).unwrap();
        Turn {
            id: TurnId {
                request_id: 1,
                sample_index: 0,
                restarts: 0,
            },
            request: Arc::new(request(1, prompt, 1, 0, sampled(1.0, 0, 1.0, 200))),
            turn: 0..response.len(),
            logprobs: vec![0.0; response.len()],
            reason: rollout::FinishReason::Eos(response[response.len() - 1]),
            response,
            turns,
            user_turns: 0,
        }
    }

    #[test]
    fn tool_results_are_the_chat_templates_own_tokens_after_the_models_turn() {
        let (tokenizer, template) = smollm2();
        let env = environment(4);
        let user = ChatMessage::new("user", "What is 98765432123 * 123456789?");
        let prompt_text = template.render(std::slice::from_ref(&user), true).unwrap();
        let prompt = tokenizer.encode(&prompt_text, false).unwrap();
        let call = "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"98765432123 * 123456789\"}}\n</tool_call>";
        let t = turn(&tokenizer, &prompt, call, 1);
        let Resume::Continue { tokens, stats } = env.answer(&t) else {
            panic!("a call must continue")
        };
        assert_eq!(
            (stats.tool_calls, stats.tool_errors, stats.tool_timeouts),
            (1, 0, 0)
        );
        assert_eq!(
            tokenizer.decode(&tokens, false).unwrap(),
            "\n<|im_start|>tool\n12193263114103033047<|im_end|>\n<|im_start|>assistant\n"
        );
        // Prompt, turn and tool tokens are exactly the whole conversation rendered once and
        // tokenized: no newline lost or added at the turn boundaries.
        let whole = template
            .render(
                &[
                    user,
                    ChatMessage::new("assistant", call),
                    ChatMessage::new("tool", "12193263114103033047"),
                ],
                true,
            )
            .unwrap();
        let mut joined = prompt.clone();
        joined.extend(&t.response);
        joined.extend(&tokens);
        assert_eq!(joined, tokenizer.encode(&whole, false).unwrap());
    }

    #[test]
    fn misbehaving_tools_and_bad_calls_become_counted_error_observations() {
        let (tokenizer, _) = smollm2();
        let env = environment(4);
        let observe = |text: &str| {
            let Resume::Continue { tokens, stats } = env.answer(&turn(&tokenizer, &[1, 2], text, 1)) else {
                panic!("{text}: the episode must go on")
            };
            (tokenizer.decode(&tokens, false).unwrap(), stats)
        };
        let call = |how: &str| {
            format!("<tool_call>{{\"name\": \"unruly\", \"arguments\": {{\"how\": \"{how}\"}}}}</tool_call>")
        };

        let started = Instant::now();
        let (text, stats) = observe(&call("hang"));
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(text.contains("Error:") && stats.tool_timeouts == 1, "{text}");
        let (text, stats) = observe(&call("panic"));
        assert!(
            text.contains("Error:") && text.contains("panicked") && stats.tool_errors == 1,
            "{text}"
        );
        let (text, stats) = observe(&call("flood"));
        assert!(
            text.contains("...(truncated)...") && text.len() < 200 && stats.tool_errors == 0,
            "{text}"
        );
        let (text, stats) = observe(&call("garbage"));
        assert!(text.contains("garbage") && stats.tool_errors == 0, "{text}");
        let (text, stats) = observe(
            "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1/0\"}}</tool_call>",
        );
        assert!(
            text.contains("Error:") && text.contains("division by zero") && stats.tool_errors == 1,
            "{text}"
        );
        let (text, stats) = observe("<tool_call>{\"name\": \"search\"}</tool_call>");
        assert!(
            text.contains("Error:") && text.contains("calculator") && stats.tool_errors == 1,
            "{text}"
        );
        let (text, stats) = observe("<tool_call>{not json</tool_call>");
        assert!(
            text.contains("Error: tool call 1") && stats.tool_errors == 1,
            "{text}"
        );
        let three = call("garbage").repeat(3);
        let (text, stats) = observe(&three);
        assert_eq!(stats.tool_calls, 3);
        assert!(text.contains("at most 2 tool calls"), "{text}");
    }

    /// The sandboxed Python executor and a user tool in a child process, inside episodes: their
    /// answers become the tool messages, and a sandbox refusal or a hung program becomes a
    /// counted error observation at the tool's own time limit.
    #[test]
    fn the_python_executor_and_a_command_tool_answer_inside_episodes() {
        use agent::{ExternalTool, Python, PythonSettings};
        let (tokenizer, template) = smollm2();
        let python = Python::new(PythonSettings {
            interpreter: "python3".into(),
            timeout: Duration::from_secs(2),
            memory_mb: 256,
            max_processes: 2,
        })
        .unwrap();
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../agent/tests/fixtures/tools.py");
        let user_tool = |name: &str| {
            Arc::new(ExternalTool::command(
                ToolSchema {
                    name: name.into(),
                    description: "A test tool.".into(),
                    parameters: json!({"type": "object", "properties": {"text": {"type": "string"}}}),
                },
                "test",
                vec!["python3".into(), fixture.into()],
                Duration::from_secs(1),
                2,
            )) as Arc<dyn Tool>
        };
        let toolbox = Toolbox::new([
            Arc::new(python) as Arc<dyn Tool>,
            user_tool("echo"),
            user_tool("hang"),
            user_tool("context"),
        ])
        .unwrap();
        let settings = ToolSettings {
            format: CallFormat::Hermes,
            max_assistant_turns: 4,
            max_parallel_calls: 2,
            max_user_turns: 0,
            max_tool_response_length: 256,
            truncate_side: TruncateSide::Middle,
            // Shorter than the tools' own limits, which are the ones that count for them.
            tool_timeout: Duration::from_millis(100),
        };
        let env = ToolEnvironment::new(toolbox, settings, template, tokenizer.clone());
        let observe = |name: &str, arguments: Value| {
            let text = format!(
                "<tool_call>\n{}\n</tool_call>",
                json!({"name": name, "arguments": arguments})
            );
            let Resume::Continue { tokens, stats } = env.answer(&turn(&tokenizer, &[1, 2], &text, 1)) else {
                panic!("{name}: the episode must go on")
            };
            (tokenizer.decode(&tokens, false).unwrap(), stats)
        };
        let (text, stats) = observe(
            "python",
            json!({"code": "import math\nprint(math.factorial(20))"}),
        );
        assert_eq!(
            text,
            "\n<|im_start|>tool\n2432902008176640000\n<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!((stats.tool_calls, stats.tool_errors), (1, 0));
        let (text, stats) = observe("python", json!({"code": "print(open('/etc/passwd').read())"}));
        assert!(
            text.contains("Error: the code exited with status 1") && text.contains("PermissionError"),
            "{text}"
        );
        assert_eq!(stats.tool_errors, 1);
        let (text, stats) = observe("echo", json!({"text": "from a child process"}));
        assert!(text.contains("tool\nfrom a child process<|im_end|>"), "{text}");
        assert_eq!(stats.tool_errors, 0);
        // A user tool receives the episode's id and the row's arguments for it (VeRL's
        // `extra_info.tools_kwargs`).
        let mut t = turn(
            &tokenizer,
            &[1, 2],
            "<tool_call>{\"name\": \"context\", \"arguments\": {}}</tool_call>",
            1,
        );
        let row =
            json!({"extra_info": {"tools_kwargs": {"context": {"create_kwargs": {"ground_truth": "42"}}}}});
        t.request = Arc::new(GenerationRequest {
            multi_turn: Some(Episode {
                max_turn_tokens: 40,
                row: Arc::new(row),
            }),
            ..(*t.request).clone()
        });
        let Resume::Continue { tokens, .. } = env.answer(&t) else {
            panic!("a call must continue")
        };
        let text = tokenizer.decode(&tokens, false).unwrap();
        let answer: Value =
            serde_json::from_str(text.split('\n').nth(2).unwrap().trim_end_matches("<|im_end|>")).unwrap();
        assert_eq!(answer["kwargs"], json!({"create_kwargs": {"ground_truth": "42"}}));
        assert!(
            answer["episode"].as_str().unwrap().ends_with("-1-0-0"),
            "{answer}"
        );
        let started = Instant::now();
        let (text, stats) = observe("hang", json!({}));
        assert!(text.contains("did not finish within 1s"), "{text}");
        assert_eq!(stats.tool_timeouts, 1);
        assert!(started.elapsed() >= Duration::from_secs(1) && started.elapsed() < Duration::from_secs(3));
    }

    /// An interaction (a grader program) answers turns without tool calls: its reply is the
    /// next user message, rendered by the template; its rewards are the sample's turn scores;
    /// `done`, the reply limit, an interaction the run lacks, or a crash end the episode.
    #[test]
    fn an_interaction_answers_turns_without_tool_calls() {
        use agent::Interaction;
        let (tokenizer, template) = smollm2();
        let fixture = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../agent/tests/fixtures/interaction.py"
        );
        let grader = Interaction::command(
            "grader",
            "test",
            vec!["python3".into(), fixture.into()],
            Duration::from_secs(5),
            2,
        );
        let settings = ToolSettings {
            format: CallFormat::Hermes,
            max_assistant_turns: 8,
            max_parallel_calls: 1,
            max_user_turns: 2,
            max_tool_response_length: 256,
            truncate_side: TruncateSide::Middle,
            tool_timeout: Duration::from_secs(1),
        };
        let env = ToolEnvironment::new(
            Toolbox::new([Arc::new(Calculator) as Arc<dyn Tool>]).unwrap(),
            settings,
            template,
            tokenizer.clone(),
        )
        .with_interactions(vec![Arc::new(grader) as Arc<dyn agent::Environment>]);
        let answer = |text: &str, user_turns: u32, kwargs: Value| {
            let mut t = turn(&tokenizer, &[1, 2], text, user_turns + 1);
            t.user_turns = user_turns;
            t.request = Arc::new(GenerationRequest {
                multi_turn: Some(Episode {
                    max_turn_tokens: 40,
                    row: Arc::new(json!({"extra_info": {"interaction_kwargs": kwargs}})),
                }),
                ..(*t.request).clone()
            });
            env.answer(&t)
        };
        let kwargs = json!({"name": "grader", "ground_truth": "42"});
        let Resume::Continue { tokens, stats } = answer("I think it is 41.", 0, kwargs.clone()) else {
            panic!("a wrong answer gets a reply")
        };
        assert_eq!(
            tokenizer.decode(&tokens, false).unwrap(),
            "\n<|im_start|>user\nNot quite, try again.<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!((stats.user_turns, stats.turn_scores.clone()), (1, vec![0.0]));
        let Resume::Finish { stats } = answer("Then 42.", 1, kwargs.clone()) else {
            panic!("the right answer ends the episode")
        };
        assert_eq!((stats.user_turns, stats.turn_scores.clone()), (1, vec![1.0]));
        // A tool call still goes to the tools.
        let call =
            "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"6*7\"}}</tool_call>";
        let Resume::Continue { stats, .. } = answer(call, 1, kwargs.clone()) else {
            panic!("a call is answered by the tool")
        };
        assert_eq!((stats.tool_calls, stats.user_turns), (1, 0));
        let Resume::Finish { stats } = answer("Still 41.", 2, kwargs.clone()) else {
            panic!("max_user_turns ends the episode")
        };
        assert_eq!(stats.user_turns, 0);
        let Resume::Finish { stats } = answer("41", 0, json!({"name": "judge"})) else {
            panic!("an interaction the run lacks ends the episode")
        };
        assert_eq!(stats.tool_errors, 1);
        let Resume::Finish { stats } = answer("crash", 0, kwargs.clone()) else {
            panic!("a crashed interaction ends the episode")
        };
        assert_eq!(stats.tool_errors, 1);
        // The program is started again for the next episode.
        assert!(matches!(answer("41", 0, json!(null)), Resume::Continue { .. }));
    }

    /// A number-guessing game written in Rust, through the `Environment` interface: its secret
    /// comes from the row at `reset`.
    #[derive(Default)]
    struct Guess {
        secrets: std::sync::Mutex<std::collections::HashMap<String, i64>>,
        closed: std::sync::Mutex<Vec<String>>,
    }

    impl agent::Environment for Guess {
        fn name(&self) -> &str {
            "guess"
        }

        fn reset(&self, episode: &str, row: &Value) -> Result<(), ToolError> {
            let secret = row["extra_info"]["secret"]
                .as_i64()
                .ok_or_else(|| ToolError::Failed("the row has no extra_info.secret".into()))?;
            self.secrets.lock().unwrap().insert(episode.into(), secret);
            Ok(())
        }

        fn step(&self, turn: &agent::EnvTurn<'_>) -> Result<agent::Reply, ToolError> {
            if turn.text == "hang" {
                std::thread::sleep(Duration::from_secs(30));
            }
            let secret = self.secrets.lock().unwrap()[turn.episode];
            let guess: i64 = turn
                .text
                .trim_end_matches('.')
                .rsplit(' ')
                .next()
                .and_then(|w| w.parse().ok())
                .ok_or_else(|| ToolError::Failed("no number in the turn".into()))?;
            let (content, done) = match guess.cmp(&secret) {
                std::cmp::Ordering::Less => ("Higher.", false),
                std::cmp::Ordering::Greater => ("Lower.", false),
                std::cmp::Ordering::Equal => ("Right.", true),
            };
            Ok(agent::Reply {
                content: content.into(),
                done,
                reward: Some(f64::from(u8::from(done))),
            })
        }

        fn close(&self, episode: &str) {
            self.secrets.lock().unwrap().remove(episode);
            self.closed.lock().unwrap().push(episode.into());
        }
    }

    /// An environment written in Rust is reset from the episode's row, stepped on each turn
    /// without calls (observation, done, reward), bounded by the run's time limit, and closed
    /// when the engine finishes the sample.
    #[test]
    fn a_rust_environment_is_reset_from_the_row_stepped_and_closed() {
        let (tokenizer, template) = smollm2();
        let game = Arc::new(Guess::default());
        let settings = ToolSettings {
            format: CallFormat::Hermes,
            max_assistant_turns: 8,
            max_parallel_calls: 1,
            max_user_turns: 4,
            max_tool_response_length: 256,
            truncate_side: TruncateSide::Middle,
            tool_timeout: Duration::from_millis(300),
        };
        let env = ToolEnvironment::new(Toolbox::new([]).unwrap(), settings, template, tokenizer.clone())
            .with_interactions(vec![game.clone() as Arc<dyn agent::Environment>]);
        let answer = |text: &str, user_turns: u32, row: Value| {
            let mut t = turn(&tokenizer, &[1, 2], text, user_turns + 1);
            t.user_turns = user_turns;
            t.request = Arc::new(GenerationRequest {
                multi_turn: Some(Episode {
                    max_turn_tokens: 40,
                    row: Arc::new(row),
                }),
                ..(*t.request).clone()
            });
            env.answer(&t)
        };
        let row = json!({"extra_info": {"secret": 42}});
        let Resume::Continue { tokens, stats } = answer("I guess 50.", 0, row.clone()) else {
            panic!("a wrong guess gets a hint")
        };
        assert_eq!(
            tokenizer.decode(&tokens, false).unwrap(),
            "\n<|im_start|>user\nLower.<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!((stats.user_turns, stats.turn_scores.clone()), (1, vec![0.0]));
        let Resume::Finish { stats } = answer("Then 42.", 1, row.clone()) else {
            panic!("the right guess ends the episode")
        };
        assert_eq!(stats.turn_scores, vec![1.0]);
        let episode: Vec<String> = game.secrets.lock().unwrap().keys().cloned().collect();
        assert_eq!(episode.len(), 1);
        assert!(episode[0].ends_with("-1-0-0"), "{episode:?}");
        env.on_finished(&rollout::Sample {
            request_id: 1,
            sample_index: 0,
            prompt_ids: vec![1, 2],
            response_ids: vec![],
            text: String::new(),
            logprobs: vec![],
            finish_reason: rollout::FinishReason::Eos(2),
            weight_version: 0,
            restarts: 0,
            env_spans: vec![],
            episode: Default::default(),
            routes: Vec::new(),
        });
        assert_eq!(*game.closed.lock().unwrap(), episode);
        assert!(game.secrets.lock().unwrap().is_empty());
        // A run the engine abandons (a weight update restarted it) is closed too.
        assert!(matches!(
            answer("I guess 50.", 0, row.clone()),
            Resume::Continue { .. }
        ));
        assert_eq!(game.secrets.lock().unwrap().len(), 1);
        env.on_abandoned(rollout::TurnId {
            request_id: 1,
            sample_index: 0,
            restarts: 0,
        });
        assert_eq!(game.closed.lock().unwrap().len(), 2);
        assert!(game.secrets.lock().unwrap().is_empty());
        // A row the game cannot reset from, and a step past the time limit, end the episode.
        let Resume::Finish { stats } = answer("50", 0, json!({})) else {
            panic!("a failed reset ends the episode")
        };
        assert_eq!((stats.tool_errors, stats.user_turns), (1, 0));
        let started = Instant::now();
        let Resume::Finish { stats } = answer("hang", 0, row) else {
            panic!("a hung step ends the episode")
        };
        assert_eq!(stats.tool_timeouts, 1);
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn an_episode_ends_without_calls_or_at_its_turn_limit() {
        let (tokenizer, _) = smollm2();
        let env = environment(2);
        let answer = |text: &str, turns| env.answer(&turn(&tokenizer, &[1, 2], text, turns));
        assert!(matches!(answer("The answer is 42.", 1), Resume::Finish { .. }));
        let call =
            "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"6*7\"}}</tool_call>";
        assert!(matches!(answer(call, 1), Resume::Continue { .. }));
        assert!(
            matches!(answer(call, 2), Resume::Finish { .. }),
            "the second turn is the last"
        );
    }
}

mod qwen3 {
    use agent::{Calculator, Tool};
    use model::{ChatTemplate, ModelTokenizer};
    use rollout::environment::TurnRenderer;
    use serde_json::json;

    /// Qwen3's template writes tool results into a user turn of `<tool_response>` blocks, and
    /// renders an assistant turn without its empty `<think>` block once messages follow it:
    /// the tokens after the model's `<|im_end|>` are still the template's own.
    #[test]
    fn qwen3s_template_puts_tool_results_in_a_user_turn_after_the_models_end_of_turn() {
        let tokenizer = ModelTokenizer::from_file(&testkit::asset("qwen3/tokenizer.json")).unwrap();
        let template =
            ChatTemplate::from_tokenizer_config(&testkit::asset("qwen3/tokenizer_config.json")).unwrap();
        let renderer = TurnRenderer::new(template, tokenizer.clone(), &[Calculator.schema()]);
        let stop = tokenizer.token_to_id("<|im_end|>").unwrap();
        let results = [
            json!({"role": "tool", "content": "42"}),
            json!({"role": "tool", "content": "7"}),
        ];
        let tokens = renderer.env_tokens(stop, &results).unwrap();
        assert_eq!(
            tokenizer.decode(&tokens, false).unwrap(),
            "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        );
    }
}

mod agent_programs {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use model::programs::HostModel;
    use rollout::agent_program::{AgentPrograms, AgentSettings};
    use rollout::{upload_weights, Engine, EngineConfig, EngineOutput, Episode, GenerationRequest};
    use serde_json::{json, Value};
    use testkit::client;
    use xla::DType;

    /// A weight update in the middle of an agent program's episode restarts the episode: the
    /// program waiting between its calls is killed, a new one drives the new run, and the
    /// sample (from the new weights) is exactly the ids the new program was served. Turns cut
    /// by `max_turn_tokens` park for the program too, so a random model's episodes go on.
    #[test]
    fn a_weight_update_restarts_an_episode_with_a_new_program() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostModel::load(&testkit::tiny_chat_model(dir.path())).unwrap();
        let template = host.chat_template.clone().unwrap();
        let logs = dir.path().join("episodes");
        std::fs::create_dir(&logs).unwrap();
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/episode_agent.py");
        let settings = AgentSettings {
            command: ["python3", fixture, logs.to_str().unwrap(), "slow", "1"]
                .map(String::from)
                .to_vec(),
            timeout: Duration::from_secs(60),
            format: agent::CallFormat::Hermes,
            max_assistant_turns: 8,
            tools: Vec::new(),
        };
        let programs = AgentPrograms::start(settings, template.clone(), host.tokenizer.clone()).unwrap();
        assert!(programs.base_url().starts_with("http://127.0.0.1:"));
        let upload = |seed| {
            let weights = model::random_init(&host.weights.config, seed);
            upload_weights(client(), &weights, DType::F32, 0).unwrap()
        };
        let mut config = EngineConfig::new(2, 256);
        config.eos_token_ids = host.stop_tokens();
        let engine = Engine::new(
            client(),
            &host.weights.config,
            upload(7),
            1,
            config,
            Some(host.tokenizer.clone()),
        )
        .unwrap()
        .spawn_with(Some(Arc::new(programs)));
        let messages = json!([{"role": "user", "content": "What is 2 + 3?"}]);
        let prompt = host
            .tokenizer
            .encode(
                &template
                    .render_with(&messages, true, &Default::default())
                    .unwrap(),
                false,
            )
            .unwrap();
        engine
            .submit(GenerationRequest {
                id: 5,
                prompt: prompt.clone(),
                n: 1,
                seed: 3,
                params: rollout::SamplingParams {
                    temperature: 1.0,
                    max_new_tokens: 60,
                    ..Default::default()
                },
                multi_turn: Some(Episode {
                    max_turn_tokens: 4,
                    row: Arc::new(json!({"prompt": messages, "extra_info": {"index": 0}})),
                }),
            })
            .unwrap();
        // The first program has had its first call and sleeps before its second.
        let first = logs.join("5-0-0.json");
        let started = Instant::now();
        while !first.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the first program never called"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        engine.control().update_weights(2, upload(8)).unwrap();
        let sample = match engine.outputs().recv_timeout(Duration::from_secs(60)).unwrap() {
            EngineOutput::Sample(s) => s,
            EngineOutput::Rejected(e) => panic!("{e}"),
        };
        assert_eq!((sample.restarts, sample.weight_version), (1, 2));
        let read = |name: &str| -> Value {
            serde_json::from_str(&std::fs::read_to_string(logs.join(name)).unwrap()).unwrap()
        };
        let killed = read("5-0-0.json");
        assert_eq!(
            killed["finished"], false,
            "the first program was killed: {killed}"
        );
        assert_eq!(killed["calls"].as_array().unwrap().len(), 1, "{killed}");
        let second = read("5-0-1.json");
        assert_eq!(second["finished"], true, "{second}");
        let calls = second["calls"].as_array().unwrap();
        assert!(calls.len() >= 2, "{second}");
        let ids = |c: &Value, key: &str| -> Vec<u32> { serde_json::from_value(c[key].clone()).unwrap() };
        let last = calls.iter().rfind(|c| c["status"] == 200).unwrap();
        let mut served = ids(last, "prompt_token_ids");
        served.extend(ids(last, "token_ids"));
        let mut trained = sample.prompt_ids.clone();
        trained.extend(&sample.response_ids);
        assert_eq!(served, trained);
        assert!(!sample.env_spans.is_empty());
        assert_eq!(sample.episode.turn_scores.len(), 1, "the program's reward");
    }
}

/// Routing replay: an engine recording routes gives each sample the experts every MoE layer
/// chose at each position it fed through the model (the prompt, the response but its last
/// token, environment tokens included), and they are the learner's own routing of the whole
/// sequence (f32), position for position, with a whole and a chunked cache.
#[test]
fn recorded_routes_are_the_learners_routing_of_every_fed_position() {
    use model::forward::{span_hidden_routed, DecoderParams};
    use xla::graph::Graph;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/fixtures/tiny/qwen3_moe");
    let weights = model::safetensors_io::load_hf_checkpoint(&path).unwrap();
    let config = &weights.config;
    let per = config.moe_layers() * config.moe.as_ref().unwrap().experts_per_token;
    let own = {
        let g = Graph::new("own_routes");
        let p = DecoderParams::declare(&g, config, DType::F32);
        let tokens = g.parameter("tokens", DType::I32, &[1, MAX_LEN as i64]);
        let mask = g.parameter("mask", DType::I32, &[1, MAX_LEN as i64]);
        let (_, _, routes) = span_hidden_routed(&p, &tokens, &mask, 1, None);
        g.build(&[&routes.unwrap().chosen])
            .unwrap()
            .compile(client())
            .unwrap()
    };
    let dm = DeviceModel::upload(client(), &weights, DType::F32, 0).unwrap();
    for kv_chunk in [0, 16] {
        let buffers = upload_weights(client(), &weights, DType::F32, 0).unwrap();
        let mut settings = EngineConfig::new(8, MAX_LEN);
        settings.kv_chunk = kv_chunk;
        settings.record_routes = true;
        let mut e = Engine::new(client(), config, buffers, 1, settings, None).unwrap();
        // Turns cut at their budget park too, so the environment answers them.
        e.set_park_cut_turns(true);
        let requests = [
            episode(1, &[4, 8, 15, 16], 3, 40, 12),
            request(2, &[7, 7, 7], 2, 3, sampled(1.0, 0, 1.0, 20)),
        ];
        let samples = run_episodes(&mut e, &requests, 3);
        assert!(
            samples.iter().any(|s| !s.env_spans.is_empty()),
            "no environment tokens"
        );
        for s in &samples {
            let mut tokens: Vec<i32> = s
                .prompt_ids
                .iter()
                .chain(&s.response_ids)
                .map(|&t| t as i32)
                .collect();
            let real = tokens.len();
            assert_eq!(s.routes.len() % per, 0);
            assert_eq!(
                s.routes.len() / per,
                real - 1,
                "request {} sample {}",
                s.request_id,
                s.sample_index
            );
            let mask: Vec<i32> = (0..MAX_LEN).map(|i| (i < real) as i32).collect();
            tokens.resize(MAX_LEN, 0);
            let t = client()
                .buffer_from_host(&tokens, &[1, MAX_LEN as i64], 0)
                .unwrap();
            let m = client().buffer_from_host(&mask, &[1, MAX_LEN as i64], 0).unwrap();
            let mut args: Vec<&xla::runtime::Buffer> = dm.weights().iter().collect();
            args.extend([&t, &m]);
            let chosen = own.execute(&args).unwrap()[0].to_host::<i32>().unwrap();
            let expected: Vec<u8> = chosen[..s.routes.len()].iter().map(|&e| e as u8).collect();
            assert_eq!(
                s.routes, expected,
                "kv_chunk {kv_chunk}: request {} sample {}",
                s.request_id, s.sample_index
            );
        }
    }
}
