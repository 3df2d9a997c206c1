//! Sequence classifiers (reward models) against transformers: the committed tiny
//! `*ForSequenceClassification` checkpoints (`model/scripts/make_tiny_reward_models.py`) score
//! their fixed sequences as transformers did, alone and padded together in one batch.

mod common;

use model::classifier::{ClassifierWeights, DeviceClassifier};
use safetensors::SafeTensors;
use xla::DType;

fn reference(family: &str) -> Vec<(Vec<u32>, Vec<f32>)> {
    let path = common::fixtures_dir()
        .join("tiny_rm")
        .join(family)
        .join("reference.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let words = |name: &str| -> Vec<[u8; 4]> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| [b[0], b[1], b[2], b[3]])
            .collect()
    };
    (0..)
        .map_while(|i| {
            st.tensor(&format!("input_ids_{i}")).ok()?;
            let ids = words(&format!("input_ids_{i}"))
                .into_iter()
                .map(|b| i32::from_le_bytes(b) as u32)
                .collect();
            let scores = words(&format!("scores_{i}"))
                .into_iter()
                .map(f32::from_le_bytes)
                .collect();
            Some((ids, scores))
        })
        .collect()
}

#[test]
fn tiny_classifiers_score_as_transformers_alone_and_batched() {
    let client = testkit::cpu_client(1);
    for (family, labels) in [("llama", 1), ("qwen2", 2), ("qwen3", 1)] {
        let weights = ClassifierWeights::load(&common::fixtures_dir().join("tiny_rm").join(family)).unwrap();
        assert_eq!(weights.config.num_labels, labels, "{family}");
        let mut classifier = DeviceClassifier::upload(client, &weights, DType::F32, 0).unwrap();
        let cases = reference(family);
        assert_eq!(cases.len(), 4, "{family}");
        let sequences: Vec<Vec<u32>> = cases.iter().map(|(ids, _)| ids.clone()).collect();
        let batched = classifier.score(&sequences).unwrap();
        for (i, (ids, expected)) in cases.iter().enumerate() {
            let alone = classifier.score(std::slice::from_ref(ids)).unwrap().remove(0);
            for (got, what) in [(&alone, "alone"), (&batched[i], "batched")] {
                assert_eq!(got.len(), labels);
                for (g, e) in got.iter().zip(expected) {
                    assert!(
                        (g - e).abs() < 2e-5,
                        "{family} sequence {i} {what}: {got:?} vs transformers {expected:?}"
                    );
                }
            }
        }
        println!("{family}: {batched:?}");
    }
}

#[test]
fn bf16_scores_stay_near_f32() {
    let client = testkit::cpu_client(1);
    let weights = ClassifierWeights::load(&common::fixtures_dir().join("tiny_rm").join("llama")).unwrap();
    let sequences: Vec<Vec<u32>> = reference("llama").into_iter().map(|(ids, _)| ids).collect();
    let f32s = DeviceClassifier::upload(client, &weights, DType::F32, 0)
        .unwrap()
        .score(&sequences)
        .unwrap();
    let bf16s = DeviceClassifier::upload(client, &weights, DType::BF16, 0)
        .unwrap()
        .score(&sequences)
        .unwrap();
    for (a, b) in f32s.iter().zip(&bf16s) {
        assert!((a[0] - b[0]).abs() < 0.05, "{a:?} vs {b:?}");
    }
}

#[test]
fn bad_checkpoints_and_inputs_are_named() {
    let tiny = common::fixtures_dir().join("tiny").join("llama");
    let e = ClassifierWeights::load(&tiny).unwrap_err().to_string();
    assert!(e.contains("LlamaForCausalLM is not a sequence classifier"), "{e}");
    let weights = ClassifierWeights::load(&common::fixtures_dir().join("tiny_rm").join("qwen3")).unwrap();
    let mut classifier = DeviceClassifier::upload(testkit::cpu_client(1), &weights, DType::F32, 0).unwrap();
    let e = classifier
        .score(&[vec![1, 2], vec![3, 999]])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sequence 1 has token id 999, outside the vocabulary of 384"),
        "{e}"
    );
    let e = classifier.score(&[vec![]]).unwrap_err().to_string();
    assert!(e.contains("sequence 0 has no tokens"), "{e}");
}

/// A causal LM read as a classifier over some tokens gives its logits of those tokens at the
/// last position: for an untied (llama) and a tied (qwen2) head.
#[test]
fn a_language_model_head_reads_as_a_classifier_over_its_tokens() {
    use model::programs::{DeviceModel, FullLogitsProgram};
    let client = testkit::cpu_client(1);
    for family in ["llama", "qwen2"] {
        let weights =
            model::safetensors_io::load_hf_checkpoint(&common::fixtures_dir().join("tiny").join(family))
                .unwrap();
        let labels = [17u32, 250, 3];
        let ids: Vec<u32> = vec![1, 17, 250, 3, 99, 383, 42];
        let device = DeviceModel::upload(client, &weights, DType::F32, 0).unwrap();
        let full = FullLogitsProgram::compile(&device, 1, ids.len())
            .unwrap()
            .run(&device, &ids, &vec![1; ids.len()])
            .unwrap();
        let last = &full[(ids.len() - 1) * 384..];
        let as_classifier = ClassifierWeights::from_lm_head(weights, &labels).unwrap();
        let got = DeviceClassifier::upload(client, &as_classifier, DType::F32, 0)
            .unwrap()
            .score(&[ids])
            .unwrap()
            .remove(0);
        for (g, &label) in got.iter().zip(&labels) {
            assert!(
                (g - last[label as usize]).abs() < 1e-5,
                "{family} token {label}: {g} vs {}",
                last[label as usize]
            );
        }
    }
}

/// A classifier saved by grpo loads back as the same tensors and scores the same.
#[test]
fn a_saved_classifier_loads_back_the_same() {
    let weights = ClassifierWeights::load(&common::fixtures_dir().join("tiny_rm").join("qwen2")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    weights.save(&dir.path().join("rm"), &[]).unwrap();
    let again = ClassifierWeights::load(&dir.path().join("rm")).unwrap();
    assert_eq!(again.config, weights.config);
    assert_eq!(again.tensors, weights.tensors);
    let trunk = model::safetensors_io::load_hf_checkpoint(&common::fixtures_dir().join("tiny").join("llama"))
        .unwrap();
    let bad = model::HostTensor::from_f32("score.weight", vec![1, 3], &[0.0; 3]);
    let e = ClassifierWeights::with_head(trunk, bad).unwrap_err().to_string();
    assert!(e.contains("score.weight") && e.contains("[1, 64]"), "{e}");
}
