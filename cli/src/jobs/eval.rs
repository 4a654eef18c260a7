//! Re-scoring a saved run (`pipebd eval`, `eval-teacher`), loading the
//! weights a config names, and exporting initial weights; the scoring and
//! the record files themselves are the engine's (`pipe_bd::eval`).

use std::path::{Path, PathBuf};

use burn::module::AutodiffModule;
use pipebd_core::{BlockSpec, StudentModule, Students};
use pipebd_kernels::DistillBackend;

use crate::config::RunConfig;
use crate::report::RunReport;
use crate::zoo::Zoo;
use pipe_bd::error::{Error, Result};
use pipe_bd::eval::{load_record, load_student_records, score, Network, Score, ScoreSection};
use pipebd_core::forward_chain;
/// Loads the trained weights a config's `[[students]]` entries name
/// (`weights = "..."`, [`RunConfig::student_weights`]) into `students`.
pub fn load_student_weights<B: DistillBackend, S: StudentModule<B>>(
    config: &RunConfig,
    mut students: Students<B, S>,
    device: &B::Device,
) -> Result<Students<B, S>> {
    let weights = config.student_weights();
    if weights.iter().all(Option::is_none) {
        return Ok(students);
    }
    let blocks = std::mem::take(&mut students.blocks);
    let mut loaded = Vec::with_capacity(blocks.len());
    for (k, block) in blocks.into_iter().enumerate() {
        let Some(path) = weights.get(k).cloned().flatten() else {
            loaded.push(block);
            continue;
        };
        let missing = format!("not found (the `weights` of block {})", k + 1);
        let context = format!("cannot load into block {}: ", k + 1);
        loaded.push(load_record(block, &path, device, &missing, &context)?);
    }
    students.blocks = loaded;
    Ok(students)
}

/// The CPU training backend the saved students are rebuilt on.
type CpuTrain = burn::backend::Autodiff<burn::backend::Flex>;

/// The student blocks saved in `run_dir` by `pipebd run` with `config`
/// (built by `zoo`, then loaded), as inference modules on the CPU, with
/// their specs.
pub fn load_students<Z: Zoo>(
    zoo: &Z,
    run_dir: &Path,
    config: &RunConfig,
    teacher: &[BlockSpec],
) -> Result<(Vec<<Z::Student<CpuTrain> as AutodiffModule<CpuTrain>>::InnerModule>, Vec<BlockSpec>)> {
    let device = Default::default();
    // The records replace the weights: the students' own init is skipped.
    let shapes = zoo.config_for_saved_weights(config);
    let students = zoo.students::<CpuTrain>(&shapes, teacher, &device)?;
    let blocks = students.blocks.into_iter().map(|b| b.valid()).collect();
    Ok((load_student_records(run_dir, blocks, &device)?, students.specs))
}

/// Figures from re-scoring a saved run.
#[derive(Debug, Clone)]
pub struct EvalResult {
    /// Accuracy of the reloaded stitched student on the test split (text:
    /// the probe's accuracy).
    pub student_accuracy: f64,
    /// The accuracy `report.json` recorded at the end of training.
    pub recorded_accuracy: f64,
    /// Test samples scored.
    pub test_samples: usize,
    /// The zoo's own sections (embedding cosines, perplexity...), re-measured.
    pub sections: Vec<ScoreSection>,
}

/// Reloads the student saved in `run_dir` (by `pipebd run` with `zoo`) and
/// scores it on the evaluation data named in the run's config (on the CPU).
pub fn eval_run<Z: Zoo>(zoo: &Z, run_dir: &Path) -> Result<EvalResult> {
    type B = burn::backend::Flex;
    let report = RunReport::read(run_dir)?;
    let config = &report.config;
    zoo.check(config)?;
    let device = Default::default();
    let workload = zoo.workload::<B>(config, &device, true)?;
    let teacher = &workload.teacher.specs;
    let (loaded, student_specs) = load_students(zoo, run_dir, config, teacher)?;
    let evaluation = workload.evaluation.as_deref();
    let scored = score(evaluation, (&workload.teacher.blocks, teacher), (&loaded, &student_specs), &device)?;
    Ok(EvalResult {
        student_accuracy: scored.student_accuracy,
        recorded_accuracy: report.student_accuracy,
        test_samples: scored.test_samples,
        sections: scored.sections,
    })
}

/// Scores the configured teacher on the test split (on the CPU): top-1
/// accuracy, or for text the probe's accuracy with the teacher's embeddings.
pub fn eval_teacher<Z: Zoo>(zoo: &Z, config: &RunConfig) -> Result<(f64, usize)> {
    type B = burn::backend::Flex;
    let device = Default::default();
    zoo.check(config)?;
    let workload = zoo.workload::<B>(config, &device, true)?;
    let Some(evaluation) = &workload.evaluation else { return Ok((0.0, 0)) };
    let blocks = &workload.teacher.blocks;
    let run_teacher = |x| forward_chain(blocks, x);
    evaluation.score_teacher(&Network::new(&run_teacher, &workload.teacher.specs), &device)
}

/// Writes the initial weights of the config's students (exactly as a run
/// starts them, built on the CPU) to `out_dir/block-K.json`: `{"block": K,
/// "params": [{"shape": [..], "values": [..]}, ..]}` in the module's
/// parameter order and burn's layouts (linear weights `[in, out]`). Returns
/// the files written.
pub fn export_initial_weights<Z: Zoo>(zoo: &Z, config: &RunConfig, out_dir: &Path) -> Result<Vec<PathBuf>> {
    zoo.check(config)?;
    let teacher = zoo.teacher_specs(config)?;
    let students = zoo.students::<CpuTrain>(config, &teacher, &Default::default())?;
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io("creating directory", out_dir, e))?;
    let mut files = Vec::new();
    for (k, block) in students.blocks.iter().enumerate() {
        let params: Vec<serde_json::Value> = pipebd_core::parameter_tensors(block)
            .into_iter()
            .map(|(shape, values)| serde_json::json!({ "shape": shape, "values": values }))
            .collect();
        let json = serde_json::json!({ "block": k + 1, "name": students.specs[k].name, "params": params });
        let path = out_dir.join(format!("block-{}.json", k + 1));
        pipe_bd::fsio::write_atomic(&path, json.to_string().as_bytes())?;
        files.push(path);
    }
    Ok(files)
}

/// Scores the stitched student of each config (built by `zoo`, starting
/// from the `weights` its blocks name) on the evaluation data of the first
/// config, loaded once (on the CPU). The configs must share data and
/// teacher (the choices of one search run do).
pub fn score_configs<Z: Zoo>(zoo: &Z, configs: &[RunConfig]) -> Result<Vec<Score>> {
    type B = burn::backend::Flex;
    let Some(first) = configs.first() else { return Ok(Vec::new()) };
    let device = Default::default();
    let workload = zoo.workload::<B>(first, &device, true)?;
    let teacher = &workload.teacher.specs;
    let mut scores = Vec::with_capacity(configs.len());
    for config in configs {
        zoo.check(config)?;
        let students = zoo.students::<CpuTrain>(config, teacher, &device)?;
        let students = load_student_weights(config, students, &device)?;
        let blocks: Vec<_> = students.blocks.iter().map(|b| b.valid()).collect();
        let evaluation = workload.evaluation.as_deref();
        let scored =
            score(evaluation, (&workload.teacher.blocks, teacher), (&blocks, &students.specs), &device)?;
        scores.push(scored);
    }
    Ok(scores)
}
