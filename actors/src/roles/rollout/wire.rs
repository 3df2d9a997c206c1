//! The rollout worker's protocol, shared by the client ([`super::RemoteRollout`]) and the server
//! ([`super::RolloutService`]): message and window sizes, the weight stream's digest, and the
//! conversions between the rollout crate's types and the protobuf messages.

use crate::proto;
use rollout::{Episode, EpisodeStats, FinishReason, GenerationRequest, Sample, SamplingParams};
use std::time::Duration;
use xla::DType;

/// Bytes of tensor data per weight chunk.
pub(crate) const CHUNK_BYTES: usize = 4 << 20;
/// The largest message either side accepts (a chunk plus its header, or a big batch of samples).
pub(crate) const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// HTTP/2 flow-control window per stream: large, so a weight stream is not throttled to a
/// round trip per 64 KiB.
pub(crate) const STREAM_WINDOW_BYTES: u32 = 32 << 20;
/// HTTP/2 flow-control window per connection.
pub(crate) const CONNECTION_WINDOW_BYTES: u32 = 64 << 20;
/// Largest HTTP/2 frame (the protocol's maximum is 16 MiB - 1).
pub(crate) const MAX_FRAME_BYTES: u32 = (1 << 24) - 1;
/// The digest of a weight stream (`UpdateWeightsReply.checksum`): CRC-32 over each chunk's
/// tensor index, offset and CRC-32, in stream order. Sender and worker compute it alike, from
/// the chunk headers alone.
#[derive(Clone, Default)]
pub(crate) struct WeightDigest(crc32fast::Hasher);

impl WeightDigest {
    pub(crate) fn add(&mut self, chunk: &proto::WeightChunk) {
        self.0.update(&chunk.tensor_index.to_le_bytes());
        self.0.update(&chunk.offset.to_le_bytes());
        self.0.update(&chunk.crc32.to_le_bytes());
    }

    pub(crate) fn value(&self) -> u32 {
        self.0.clone().finalize()
    }
}

/// "f32" / "bf16" as on the wire.
pub(crate) fn parse_dtype(name: &str) -> Option<DType> {
    name.parse()
        .ok()
        .filter(|d| matches!(d, DType::F32 | DType::BF16))
}

pub(crate) fn request_to_proto(r: &GenerationRequest) -> proto::GenerationRequest {
    let p = &r.params;
    proto::GenerationRequest {
        id: r.id,
        prompt: r.prompt.clone(),
        n: r.n as u64,
        seed: r.seed,
        params: Some(proto::SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as u64,
            top_p: p.top_p,
            min_p: p.min_p,
            max_new_tokens: p.max_new_tokens as u64,
            stop_token_ids: p.stop_token_ids.clone(),
            stop_strings: p.stop_strings.clone(),
        }),
        max_turn_tokens: r.multi_turn.as_ref().map(|t| t.max_turn_tokens as u64),
        episode_row: r
            .multi_turn
            .as_ref()
            .map(|t| t.row.to_string())
            .unwrap_or_default(),
    }
}

pub(crate) fn request_from_proto(r: proto::GenerationRequest) -> Result<GenerationRequest, String> {
    let p = r
        .params
        .ok_or_else(|| format!("request {} has no sampling parameters", r.id))?;
    Ok(GenerationRequest {
        id: r.id,
        prompt: r.prompt,
        n: r.n as usize,
        seed: r.seed,
        params: SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: p.top_p,
            min_p: p.min_p,
            max_new_tokens: p.max_new_tokens as usize,
            stop_token_ids: p.stop_token_ids,
            stop_strings: p.stop_strings,
        },
        multi_turn: match r.max_turn_tokens {
            None => None,
            Some(t) => Some(Episode {
                max_turn_tokens: t as usize,
                row: std::sync::Arc::new(if r.episode_row.is_empty() {
                    serde_json::Value::Null
                } else {
                    serde_json::from_str(&r.episode_row)
                        .map_err(|e| format!("request {}: its episode row is not JSON: {e}", r.id))?
                }),
            }),
        },
    })
}

pub(crate) fn sample_to_proto(s: Sample) -> proto::GeneratedSample {
    use proto::FinishKind;
    let (kind, eos_token, stop_string) = match s.finish_reason {
        FinishReason::Eos(id) => (FinishKind::Eos, id, String::new()),
        FinishReason::StopString(text) => (FinishKind::StopString, 0, text),
        FinishReason::MaxNewTokens => (FinishKind::MaxNewTokens, 0, String::new()),
        FinishReason::MaxModelLen => (FinishKind::MaxModelLen, 0, String::new()),
        FinishReason::MaxTurnTokens => (FinishKind::MaxTurnTokens, 0, String::new()),
    };
    proto::GeneratedSample {
        request_id: s.request_id,
        sample_index: s.sample_index as u64,
        prompt_ids: s.prompt_ids,
        response_ids: s.response_ids,
        text: s.text,
        logprobs: s.logprobs,
        finish_kind: kind as i32,
        eos_token,
        stop_string,
        weight_version: s.weight_version,
        restarts: s.restarts,
        env_spans: s
            .env_spans
            .iter()
            .flat_map(|r| [r.start as u64, r.end as u64])
            .collect(),
        turns: s.episode.turns,
        tool_calls: s.episode.tool_calls,
        tool_errors: s.episode.tool_errors,
        tool_timeouts: s.episode.tool_timeouts,
        env_seconds: s.episode.env_time.as_secs_f64(),
        user_turns: s.episode.user_turns,
        turn_scores: s.episode.turn_scores,
        routes: s.routes,
    }
}

pub(crate) fn sample_from_proto(s: proto::GeneratedSample) -> Result<Sample, String> {
    use proto::FinishKind;
    let finish_reason = match FinishKind::try_from(s.finish_kind) {
        Ok(FinishKind::Eos) => FinishReason::Eos(s.eos_token),
        Ok(FinishKind::StopString) => FinishReason::StopString(s.stop_string),
        Ok(FinishKind::MaxNewTokens) => FinishReason::MaxNewTokens,
        Ok(FinishKind::MaxModelLen) => FinishReason::MaxModelLen,
        Ok(FinishKind::MaxTurnTokens) => FinishReason::MaxTurnTokens,
        _ => {
            return Err(format!(
                "sample {} of request {} with an unknown finish reason ({})",
                s.sample_index, s.request_id, s.finish_kind
            ))
        }
    };
    let bad = |what: &str| format!("sample {} of request {}: {what}", s.sample_index, s.request_id);
    if !s.env_spans.len().is_multiple_of(2) {
        return Err(bad("env_spans holds an odd number of bounds"));
    }
    let env_spans: Vec<std::ops::Range<usize>> = s
        .env_spans
        .chunks(2)
        .map(|p| p[0] as usize..p[1] as usize)
        .collect();
    let mut end = 0;
    for span in &env_spans {
        if span.start < end || span.end <= span.start || span.end > s.response_ids.len() {
            return Err(bad(&format!(
                "environment span {span:?} is empty, out of order or past the {} response tokens",
                s.response_ids.len()
            )));
        }
        end = span.end;
    }
    if !(s.env_seconds.is_finite() && s.env_seconds >= 0.0) {
        return Err(bad(&format!("env_seconds is {}", s.env_seconds)));
    }
    if let Some(score) = s.turn_scores.iter().find(|x| !x.is_finite()) {
        return Err(bad(&format!("a turn score is {score}")));
    }
    Ok(Sample {
        request_id: s.request_id,
        sample_index: s.sample_index as usize,
        prompt_ids: s.prompt_ids,
        response_ids: s.response_ids,
        text: s.text,
        logprobs: s.logprobs,
        finish_reason,
        weight_version: s.weight_version,
        restarts: s.restarts,
        env_spans,
        episode: EpisodeStats {
            turns: s.turns,
            tool_calls: s.tool_calls,
            tool_errors: s.tool_errors,
            tool_timeouts: s.tool_timeouts,
            env_time: Duration::from_secs_f64(s.env_seconds),
            user_turns: s.user_turns,
            turn_scores: s.turn_scores,
        },
        // Checked against the model where they are replayed (`DecoderPolicy::pack_routed`).
        routes: s.routes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(finish_reason: FinishReason) -> Sample {
        Sample {
            request_id: 7,
            sample_index: 3,
            prompt_ids: vec![1, 2, 3],
            response_ids: vec![9, 8, 5, 6, 7],
            text: "hi".into(),
            logprobs: vec![-0.5, 0.0, -1.25, 0.0, -2.0],
            finish_reason,
            weight_version: 4,
            restarts: 1,
            env_spans: vec![1..2, 3..4],
            episode: EpisodeStats {
                turns: 2,
                tool_calls: 1,
                tool_errors: 1,
                tool_timeouts: 0,
                env_time: Duration::from_millis(1500),
                user_turns: 1,
                turn_scores: vec![0.0, 1.0],
            },
            routes: Vec::new(),
        }
    }

    #[test]
    fn samples_survive_the_wire_with_every_finish_reason() {
        for reason in [
            FinishReason::Eos(2),
            FinishReason::StopString("####".into()),
            FinishReason::MaxNewTokens,
            FinishReason::MaxModelLen,
            FinishReason::MaxTurnTokens,
        ] {
            let s = sample(reason);
            let back = sample_from_proto(sample_to_proto(s.clone())).unwrap();
            assert_eq!(format!("{back:?}"), format!("{s:?}"));
        }
        let mut bad = sample_to_proto(sample(FinishReason::MaxNewTokens));
        bad.finish_kind = 0;
        assert_eq!(
            sample_from_proto(bad).unwrap_err(),
            "sample 3 of request 7 with an unknown finish reason (0)"
        );
        for spans in [vec![2], vec![2, 6], vec![3, 2], vec![1, 3, 2, 4]] {
            let mut bad = sample_to_proto(sample(FinishReason::MaxNewTokens));
            bad.env_spans = spans.clone();
            assert!(sample_from_proto(bad).is_err(), "{spans:?} accepted");
        }
    }

    #[test]
    fn requests_survive_the_wire() {
        let r = GenerationRequest {
            id: 11,
            prompt: vec![5, 6],
            n: 4,
            seed: 99,
            params: SamplingParams {
                temperature: 0.7,
                top_k: 20,
                top_p: 0.9,
                min_p: 0.05,
                max_new_tokens: 33,
                stop_token_ids: vec![2],
                stop_strings: vec!["</answer>".into()],
            },
            multi_turn: Some(Episode {
                max_turn_tokens: 21,
                row: std::sync::Arc::new(
                    serde_json::json!({"extra_info": {"tools_kwargs": {"search": {"create_kwargs": {"k": 1}}}}}),
                ),
            }),
        };
        let back = request_from_proto(request_to_proto(&r)).unwrap();
        assert_eq!(format!("{back:?}"), format!("{r:?}"));
        let mut no_params = request_to_proto(&r);
        no_params.params = None;
        assert_eq!(
            request_from_proto(no_params).unwrap_err(),
            "request 11 has no sampling parameters"
        );
    }
}
