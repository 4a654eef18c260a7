//! The MiniLM teacher is the real all-MiniLM-L6-v2: same token ids and the
//! same sentence embeddings as the reference Python implementation
//! (sentence-transformers), recorded in `../shared/reference/minilm-l6.json`
//! and copied to `tests/data/minilm-l6-reference.json`.

use burn::backend::Flex;
use pipe_bd::block::{forward_chain, Activation};
use pipe_bd::config::RunConfig;
use pipe_bd::text::{cosine, sentence_embeddings};
use pipe_bd::zoo::build_minilm;
use pipebd_teachers::minilm::MiniLmTokenizer;
use serde::Deserialize;

mod common;

#[derive(Deserialize)]
struct Reference {
    max_length: usize,
    sentences: Vec<Sentence>,
}

#[derive(Deserialize)]
struct Sentence {
    text: String,
    input_ids: Vec<u32>,
    embedding: Vec<f32>,
}

fn reference() -> Reference {
    let path = common::repo().join("tests/data/minilm-l6-reference.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn config(layers_per_block: Option<Vec<usize>>, max_tokens: usize) -> RunConfig {
    let mut config = common::minilm_config(64, 16, 1, max_tokens);
    config.teacher.layers_per_block = layers_per_block;
    config
}

#[test]
fn teacher_reproduces_the_reference_ids_and_embeddings() {
    let reference = reference();
    let config = config(None, reference.max_length);
    let tokenizer = MiniLmTokenizer::load(&config.teacher.tokenizer_path()).unwrap();
    let device = Default::default();
    let (embeddings, teacher) = build_minilm::<Flex>(&config, &device).unwrap();
    let mut ids = Vec::new();
    for sentence in &reference.sentences {
        let ours = tokenizer.encode(&sentence.text, reference.max_length).unwrap();
        assert_eq!(ours, sentence.input_ids, "token ids of {:?}", sentence.text);
        ids.push(ours);
    }
    let ours =
        sentence_embeddings(&embeddings, &teacher.blocks, &ids, reference.max_length, &device, 3).unwrap();
    for (sentence, embedding) in reference.sentences.iter().zip(&ours) {
        let similarity = cosine(embedding, &sentence.embedding);
        assert!(similarity >= 0.9999, "cosine {similarity} for {:?}", sentence.text);
    }
}

#[test]
fn grouping_layers_into_blocks_does_not_change_the_teacher() {
    let reference = reference();
    let device = Default::default();
    let tokenizer = MiniLmTokenizer::load(&config(None, 32).teacher.tokenizer_path()).unwrap();
    let ids: Vec<Vec<u32>> =
        reference.sentences.iter().take(3).map(|s| tokenizer.encode(&s.text, 32).unwrap()).collect();
    let (embeddings, six) = build_minilm::<Flex>(&config(None, 32), &device).unwrap();
    let (_, three) = build_minilm::<Flex>(&config(Some(vec![2, 3, 1]), 32), &device).unwrap();
    assert_eq!(three.blocks.len(), 3);
    assert_eq!(
        three.specs.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        ["layers1-2", "layers3-5", "layer6"]
    );
    let flops = |t: &pipe_bd::block::Teacher<Flex, _>| t.specs.iter().map(|s| s.flops).sum::<u64>();
    assert_eq!(flops(&six), flops(&three));
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let input = pipe_bd::text::embed_batch(&embeddings, &refs, 32, &device);
    let (Activation::Tokens { hidden: a, .. }, Activation::Tokens { hidden: b, .. }) =
        (forward_chain(&six.blocks, input.clone()).unwrap(), forward_chain(&three.blocks, input).unwrap())
    else {
        panic!("token states expected");
    };
    let diff = (a - b).abs().max().into_scalar();
    assert!(diff < 1e-5, "{diff}");
}
