//! Tokenizers: a Hugging Face `tokenizer.json` through the `tokenizers` crate, or one built from
//! a GGUF file's byte-level BPE vocabulary, merges and special tokens; and the check that a
//! tokenizer fits the model's vocabulary.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::gguf::{GgufFile, GgufValue};

/// GGUF pre-tokenizer names (`tokenizer.ggml.pre`) whose llama.cpp regexes are "split every
/// digit, then the GPT-2 regex": Hugging Face `Digits(individual) + ByteLevel(use_regex)`.
const DIGIT_SPLITTING_PRE: &[&str] = &["smollm", "starcoder", "refact"];
/// GGUF pre-tokenizer names that are the plain GPT-2 regex.
const GPT2_PRE: &[&str] = &["gpt2", "default"];
/// GGUF pre-tokenizer names of Llama 3 (digits in groups of up to three; merges ignored when a
/// whole word is in the vocabulary, as llama.cpp does for this type).
const LLAMA3_PRE: &[&str] = &["llama-bpe", "llama3"];
/// GGUF pre-tokenizer names of Qwen2 / Qwen3 (single digits; NFC-normalised like the original).
const QWEN2_PRE: &[&str] = &["qwen2"];
/// Llama 3's split regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`, HF `Split` pattern).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex: Llama 3's with single digits.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer with the name of the file it came from.
#[derive(Clone)]
pub struct ModelTokenizer {
    inner: tokenizers::Tokenizer,
    origin: String,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl ModelTokenizer {
    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<ModelTokenizer> {
        let bytes = std::fs::read(path).map_err(|e| ModelError::io("reading", path, e))?;
        Self::from_json_bytes(&bytes, &path.display().to_string())
    }

    /// Parses the bytes of a `tokenizer.json`; `origin` names it in errors.
    ///
    /// The bytes must be JSON before the `tokenizers` crate sees them: it unwraps the results
    /// of some of its nested parses (its decoders'), so malformed JSON there is a panic, not an
    /// error. Any panic it still raises becomes an error here.
    pub fn from_json_bytes(bytes: &[u8], origin: &str) -> Result<ModelTokenizer> {
        let invalid = |detail: String| ModelError::Tokenizer {
            origin: origin.to_string(),
            detail: format!("not a valid tokenizer.json: {detail}"),
        };
        serde_json::from_slice::<serde::de::IgnoredAny>(bytes).map_err(|e| invalid(e.to_string()))?;
        let parsed =
            std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(bytes)).map_err(|panic| {
                let what = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                invalid(format!("the tokenizers library failed on it ({what})"))
            })?;
        let inner = parsed.map_err(|e| invalid(e.to_string()))?;
        Ok(ModelTokenizer {
            inner,
            origin: origin.to_string(),
        })
    }

    /// The `tokenizer.json` equivalent of a GGUF file's tokenizer (byte-level BPE, the `gpt2`
    /// tokenizer model of llama.cpp): vocabulary from `tokenizer.ggml.tokens`, merges from
    /// `tokenizer.ggml.merges`, control tokens (type 3) and user-defined tokens (type 4) as
    /// added special tokens, and the pre-tokenizer that `tokenizer.ggml.pre` names.
    pub fn gguf_tokenizer_json(gguf: &GgufFile) -> Result<Value> {
        let origin = gguf.path().display().to_string();
        let err = |detail: String| ModelError::Tokenizer {
            origin: origin.clone(),
            detail,
        };
        let model = gguf.metadata_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(err(format!(
                "tokenizer.ggml.model is `{model}`; only byte-level BPE (`gpt2`) GGUF tokenizers are supported"
            )));
        }
        let pre = match gguf.metadata("tokenizer.ggml.pre") {
            Some(_) => gguf.metadata_str("tokenizer.ggml.pre")?,
            None => "default",
        };
        let byte_level =
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        let split_then_bytes = |regex: &str| {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})
        };
        let mut normalizer = Value::Null;
        let mut ignore_merges = false;
        let pre_tokenizer = if DIGIT_SPLITTING_PRE.contains(&pre) {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level]})
        } else if GPT2_PRE.contains(&pre) {
            byte_level
        } else if LLAMA3_PRE.contains(&pre) {
            ignore_merges = true;
            split_then_bytes(LLAMA3_REGEX)
        } else if QWEN2_PRE.contains(&pre) {
            normalizer = json!({"type": "NFC"});
            split_then_bytes(QWEN2_REGEX)
        } else {
            return Err(err(format!(
                "pre-tokenizer `{pre}` (tokenizer.ggml.pre) is not supported; supported: {}",
                [DIGIT_SPLITTING_PRE, GPT2_PRE, LLAMA3_PRE, QWEN2_PRE]
                    .concat()
                    .join(", ")
            )));
        };
        let tokens = gguf.metadata_strings("tokenizer.ggml.tokens")?;
        let types = match gguf.metadata("tokenizer.ggml.token_type") {
            Some(_) => gguf.metadata_ints("tokenizer.ggml.token_type")?,
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(err(format!(
                "tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
                types.len(),
                tokens.len()
            )));
        }
        let merges = gguf.metadata_strings("tokenizer.ggml.merges")?;
        let mut vocab = Map::with_capacity(tokens.len());
        let mut added = Vec::new();
        for (id, (token, kind)) in tokens.iter().zip(&types).enumerate() {
            vocab.insert(token.to_string(), json!(id));
            if *kind == 3 || *kind == 4 {
                added.push(json!({"id": id, "content": token, "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
            }
        }
        let merges: Vec<Value> = merges
            .iter()
            .enumerate()
            .map(|(i, m)| {
                m.split_once(' ')
                    .map(|(a, b)| json!([a, b]))
                    .ok_or_else(|| err(format!("merge {i} `{m}` is not two tokens separated by a space")))
            })
            .collect::<Result<_>>()?;
        let byte_level_post =
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true});
        let add_bos = matches!(
            gguf.metadata("tokenizer.ggml.add_bos_token"),
            Some(GgufValue::Bool(true))
        );
        let post_processor = match (add_bos, gguf.metadata("tokenizer.ggml.bos_token_id")) {
            (true, Some(_)) => {
                let bos_id = gguf.metadata_usize("tokenizer.ggml.bos_token_id")?;
                let bos = tokens.get(bos_id).ok_or_else(|| {
                    err(format!(
                        "tokenizer.ggml.bos_token_id {bos_id} is not a token id (vocabulary of {})",
                        tokens.len()
                    ))
                })?;
                json!({"type": "Sequence", "processors": [byte_level_post, {
                    "type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                             {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {*bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}]})
            }
            _ => byte_level_post,
        };
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                "vocab": vocab, "merges": merges}
        }))
    }

    /// Builds the tokenizer of a GGUF file (see [`ModelTokenizer::gguf_tokenizer_json`]).
    pub fn from_gguf(gguf: &GgufFile) -> Result<ModelTokenizer> {
        let json = Self::gguf_tokenizer_json(gguf)?;
        let bytes = serde_json::to_vec(&json).expect("JSON values serialise");
        Self::from_json_bytes(&bytes, &format!("{} (GGUF vocabulary)", gguf.path().display()))
    }

    /// Where the tokenizer came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become their
    /// ids; `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS token).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding =
            self.inner
                .encode_fast(text, add_special_tokens)
                .map_err(|e| ModelError::Tokenizer {
                    origin: self.origin.clone(),
                    detail: format!("encoding failed: {e}"),
                })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, optionally without special tokens.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer {
                origin: self.origin.clone(),
                detail: format!("decoding {} ids failed: {e}", ids.len()),
            })
    }

    /// The id of a token string (vocabulary or added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of tokens including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Largest token id.
    pub fn max_id(&self) -> u32 {
        self.inner.get_vocab(true).values().copied().max().unwrap_or(0)
    }

    /// Checks that every token id indexes a row of the model's embedding table.
    pub fn check_fits(&self, config: &ModelConfig) -> Result<()> {
        let max_id = self.max_id();
        if max_id as usize >= config.vocab_size {
            return Err(ModelError::VocabMismatch {
                origin: self.origin.clone(),
                tokenizer_size: self.vocab_size(),
                max_id,
                vocab_size: config.vocab_size,
            });
        }
        Ok(())
    }

    /// The tokens that end generation: the config's `eos_token_id`s, then the chat template's
    /// EOS token (e.g. `<|im_end|>` or `<|eot_id|>`) when it is a different token.
    pub fn stop_token_ids(
        &self,
        config: &ModelConfig,
        template: Option<&crate::chat::ChatTemplate>,
    ) -> Vec<u32> {
        let mut ids = config.eos_token_ids.clone();
        if let Some(id) = template
            .and_then(|t| t.eos_token.as_deref())
            .and_then(|token| self.token_to_id(token))
        {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    /// The padding token: the config's `pad_token_id`, else the template's pad token, else the
    /// first stop token; `None` when there is none of these.
    pub fn pad_token_id(
        &self,
        config: &ModelConfig,
        template: Option<&crate::chat::ChatTemplate>,
    ) -> Option<u32> {
        config
            .pad_token_id
            .or_else(|| {
                template
                    .and_then(|t| t.pad_token.as_deref())
                    .and_then(|token| self.token_to_id(token))
            })
            .or_else(|| self.stop_token_ids(config, template).first().copied())
    }

    /// Writes the tokenizer as a `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = self.inner.to_string(false).map_err(|e| ModelError::Tokenizer {
            origin: self.origin.clone(),
            detail: format!("serialising failed: {e}"),
        })?;
        std::fs::write(path, text).map_err(|e| ModelError::io("writing", path, e))
    }
}

/// Writes a GGUF's tokenizer as Hugging Face files in `dir`: `tokenizer.json` (checked to fit
/// `config`'s vocabulary) and, when the GGUF has a chat template, `tokenizer_config.json`
/// holding it. Returns the paths written, for [`crate::save_hf_checkpoint`].
pub fn write_gguf_tokenizer_files(
    gguf: &GgufFile,
    config: &ModelConfig,
    dir: &Path,
) -> Result<Vec<std::path::PathBuf>> {
    let tokenizer = ModelTokenizer::from_gguf(gguf)?;
    tokenizer.check_fits(config)?;
    let tokenizer_json = dir.join("tokenizer.json");
    tokenizer.save(&tokenizer_json)?;
    let mut files = vec![tokenizer_json];
    if let Ok(template) = crate::chat::ChatTemplate::from_gguf(gguf) {
        let path = dir.join("tokenizer_config.json");
        let json = template.tokenizer_config_json(config.max_position_embeddings);
        let text = serde_json::to_string_pretty(&json).expect("JSON values serialise");
        std::fs::write(&path, text + "\n").map_err(|e| ModelError::io("writing", &path, e))?;
        files.push(path);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::tests::{gguf_string, write_gguf};

    fn string_array(items: &[&str]) -> Vec<u8> {
        let mut v = 8u32.to_le_bytes().to_vec();
        v.extend((items.len() as u64).to_le_bytes());
        for s in items {
            v.extend(gguf_string(s));
        }
        v
    }

    fn tiny_gguf(dir: &Path, pre: &str) -> std::path::PathBuf {
        let path = dir.join(format!("tok-{pre}.gguf"));
        // Byte-level alphabet for "ab12 " plus merges "Ġ a" -> "Ġa" (rank 0), "a b" -> "ab", "1 2".
        let tokens = ["<|end|>", "a", "b", "1", "2", "Ġ", "ab", "Ġa", "12"];
        let mut types = 5u32.to_le_bytes().to_vec(); // i32 array
        types.extend((tokens.len() as u64).to_le_bytes());
        for t in [3i32, 1, 1, 1, 1, 1, 1, 1, 1] {
            types.extend(t.to_le_bytes());
        }
        write_gguf(
            &path,
            &[
                ("tokenizer.ggml.model", 8, gguf_string("gpt2")),
                ("tokenizer.ggml.pre", 8, gguf_string(pre)),
                ("tokenizer.ggml.tokens", 9, string_array(&tokens)),
                ("tokenizer.ggml.token_type", 9, types),
                ("tokenizer.ggml.merges", 9, string_array(&["Ġ a", "a b", "1 2"])),
            ],
            &[],
        );
        path
    }

    #[test]
    fn gguf_vocabulary_tokenizer_splits_digits_for_smollm() {
        let dir = tempfile::tempdir().unwrap();
        let smol =
            ModelTokenizer::from_gguf(&GgufFile::open(&tiny_gguf(dir.path(), "smollm")).unwrap()).unwrap();
        // "ab ab12<|end|>": digits are split one by one, so the "1 2" merge never applies.
        assert_eq!(
            smol.encode("ab ab12<|end|>", false).unwrap(),
            vec![6, 7, 2, 3, 4, 0]
        );
        assert_eq!(smol.decode(&[6, 7, 2, 3, 4, 0], true).unwrap(), "ab ab12");
        let gpt2 =
            ModelTokenizer::from_gguf(&GgufFile::open(&tiny_gguf(dir.path(), "gpt2")).unwrap()).unwrap();
        assert_eq!(gpt2.encode("ab12", false).unwrap(), vec![6, 8]);
        let e =
            ModelTokenizer::from_gguf(&GgufFile::open(&tiny_gguf(dir.path(), "qwen9")).unwrap()).unwrap_err();
        assert!(e.to_string().contains("pre-tokenizer `qwen9` (tokenizer.ggml.pre) is not supported; supported: smollm, starcoder, refact, gpt2, default, llama-bpe, llama3, qwen2"), "{e}");
    }

    #[test]
    fn add_bos_token_prepends_bos() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bos.gguf");
        let tokens = ["<s>", "a", "b", "ab"];
        let mut types = 5u32.to_le_bytes().to_vec();
        types.extend((tokens.len() as u64).to_le_bytes());
        for t in [3i32, 1, 1, 1] {
            types.extend(t.to_le_bytes());
        }
        write_gguf(
            &path,
            &[
                ("tokenizer.ggml.model", 8, gguf_string("gpt2")),
                ("tokenizer.ggml.pre", 8, gguf_string("llama-bpe")),
                ("tokenizer.ggml.tokens", 9, string_array(&tokens)),
                ("tokenizer.ggml.token_type", 9, types),
                ("tokenizer.ggml.merges", 9, string_array(&["a b"])),
                ("tokenizer.ggml.bos_token_id", 4, 0u32.to_le_bytes().to_vec()),
                ("tokenizer.ggml.add_bos_token", 7, vec![1]),
            ],
            &[],
        );
        let tok = ModelTokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        assert_eq!(tok.encode("abab", true).unwrap(), vec![0, 3, 3]);
        assert_eq!(tok.encode("abab", false).unwrap(), vec![3, 3]);
    }

    #[test]
    fn vocab_check_and_bad_json() {
        let dir = tempfile::tempdir().unwrap();
        let tok =
            ModelTokenizer::from_gguf(&GgufFile::open(&tiny_gguf(dir.path(), "smollm")).unwrap()).unwrap();
        let mut config = crate::init::tests_support::tiny_config();
        config.vocab_size = 9;
        tok.check_fits(&config).unwrap();
        config.vocab_size = 8;
        let e = tok.check_fits(&config).unwrap_err().to_string();
        assert!(e.ends_with("has 9 tokens (largest id 8) but the model's vocab_size is 8: the tokenizer does not belong to this model"), "{e}");
        let path = dir.path().join("tokenizer.json");
        tok.save(&path).unwrap();
        let again = ModelTokenizer::from_file(&path).unwrap();
        assert_eq!(again.encode("ab ab12", false).unwrap(), vec![6, 7, 2, 3, 4]);
        std::fs::write(&path, "{\"model\": 3}").unwrap();
        let e = ModelTokenizer::from_file(&path).unwrap_err().to_string();
        assert!(e.contains("tokenizer.json: not a valid tokenizer.json"), "{e}");
    }
}
