//! Checks a config before any heavy work: devices, student shapes, the
//! schedule, the files it names, and the output folder.

use std::path::Path;

use pipebd_core::BlockSpec;

use crate::config::RunConfig;
use crate::zoo::Zoo;
use pipe_bd::device::{parse_slots, DeviceSpec};
use pipe_bd::error::{Error, Result};
use pipe_bd::plan::{flops_cost, Plan, Schedule};

/// `pipebd check <path>`: the config file read, parsed and [`preflight`]ed;
/// errors about the config name its file (as every command's do).
pub fn check_file<Z: Zoo>(zoo: &Z, path: &Path) -> Result<RunConfig> {
    let check = || -> Result<RunConfig> {
        let config = zoo.load_config(path, crate::config::Overrides::default())?;
        preflight(zoo, &config)?;
        Ok(config)
    };
    check().map_err(|e| e.in_config(path))
}

/// Checks a config before any heavy work: the zoo's config checks, devices
/// usable, student shapes matching the teacher's, schedule buildable, and
/// the files it names there and readable ([`Zoo::check_inputs`]). Returns
/// the device slots and the plan (`None` for `schedule = "auto"`, planned
/// from a profile later).
pub fn preflight<Z: Zoo>(zoo: &Z, config: &RunConfig) -> Result<(Vec<DeviceSpec>, Option<Plan>)> {
    zoo.check(config)?;
    let slots = config.device_slots();
    let devices =
        parse_slots(&slots).map_err(|message| Error::Device { device: slots.join(","), message })?;
    for device in &devices {
        device.check_available()?;
    }
    let teacher = zoo.teacher_specs(config)?;
    let students = zoo.student_specs(config, &teacher)?;
    check_output_loss(zoo, config, &teacher)?;
    let plan = match config.schedule()? {
        Schedule::Auto => None,
        _ => Some(plan_for(config, &teacher, &students, devices.len())?),
    };
    zoo.check_inputs(config)?;
    check_batch_fits(zoo, config)?;
    for (k, weights) in config.student_weights().into_iter().enumerate() {
        if let Some(path) = weights.filter(|p| !p.is_file()) {
            return Err(Error::RecordInput {
                path,
                message: format!("not found (the `weights` of block {}: a file saved by a run)", k + 1),
            });
        }
    }
    Ok((devices, plan))
}

/// Fails when the batch is larger than the training set (after a search's
/// held-out share), where the zoo knows its size: `run` would refuse it
/// after loading everything.
fn check_batch_fits<Z: Zoo>(zoo: &Z, config: &RunConfig) -> Result<()> {
    let Some(samples) = zoo.train_samples(config)? else {
        return Ok(());
    };
    let held_out = match config.has_candidates() {
        true => {
            ((samples as f64 * config.search.held_out).round() as usize).clamp(1, samples.saturating_sub(1))
        }
        false => 0,
    };
    let trained_on = samples - held_out;
    let batch = config.train.batch_size;
    if batch <= trained_on {
        return Ok(());
    }
    let held = if held_out > 0 {
        format!(" ({held_out} of {samples} held out for the search)")
    } else {
        String::new()
    };
    Err(Error::Config {
        path: format!("config `{}`", config.name).into(),
        line: None,
        field: Some("train.batch_size".into()),
        message: format!(
            "{batch} is larger than the {trained_on} training samples{held}: not one step would run"
        ),
    })
}

/// Fails unless the stitched pass's output loss, if any, can compare the
/// teacher's final output (a pooled cosine needs token states, `head-kl`
/// the zoo's output head).
fn check_output_loss<Z: Zoo>(zoo: &Z, config: &RunConfig, teacher: &[BlockSpec]) -> Result<()> {
    let Some(output_loss) = config.train.stitched_output_loss else {
        return Ok(());
    };
    let refuse = |message: String| Error::Config {
        path: format!("config `{}`", config.name).into(),
        line: None,
        field: Some("train.stitched_output_loss".into()),
        message,
    };
    let Some(kind) = output_loss.block_loss() else {
        if zoo.has_output_head(config) {
            return Ok(());
        }
        return Err(refuse(format!(
            "`head-kl` scores the final outputs through the teacher's frozen output head (an LM head), and teacher `{}` has none: use a block loss (`mse`, `soft-target-cross-entropy`, `pooled-cosine`)",
            config.teacher.kind
        )));
    };
    match teacher.last() {
        Some(last) if !kind.accepts(&last.output_shape) => Err(refuse(format!(
            "`{}` cannot compare the teacher's final output (per-sample shape {:?}, block `{}`): `pooled-cosine` needs token states, `soft-target-cross-entropy` logits",
            kind.name(),
            last.output_shape,
            last.name
        ))),
        _ => Ok(()),
    }
}

/// Fails, before any work, when the output folder of a run (`--out`), or a
/// folder it would be created in, is an existing file.
pub fn check_out_dir(out_dir: &Path) -> Result<()> {
    let Some(existing) = out_dir.ancestors().find(|p| p.exists()) else {
        return Ok(());
    };
    if existing.is_dir() {
        return Ok(());
    }
    let message = if existing == out_dir {
        format!("{} is a file, expected a directory", out_dir.display())
    } else {
        format!("{}: {} is a file, expected a directory", out_dir.display(), existing.display())
    };
    Err(Error::Config { path: "--out".into(), line: None, field: None, message })
}

/// The plan a config asks for, over `slots` device slots.
pub fn plan_for(
    config: &RunConfig,
    teacher: &[BlockSpec],
    students: &[BlockSpec],
    slots: usize,
) -> Result<Plan> {
    let cost = flops_cost(teacher, students);
    Plan::named(&config.schedule, teacher.len(), slots, &cost, &config.stages)
        .map_err(|e| Error::Plan { plan: config.schedule.clone(), message: e.0 })
}
