//! Checks a config before any heavy work: devices, student shapes, the
//! schedule, the files it names, and the output folder.

use std::path::Path;

use pipebd_core::BlockSpec;

use crate::config::RunConfig;
use crate::device::{parse_slots, DeviceSpec};
use crate::error::{Error, Result};
use crate::plan::{flops_cost, Plan, Schedule};
use crate::zoo::{student_specs, teacher_specs};

/// Checks a config before any heavy work: devices usable, student shapes
/// matching the teacher's, schedule buildable, and the files it names there
/// and readable ([`check_inputs`]). Returns the device slots and the plan
/// (`None` for `schedule = "auto"`, planned from a profile later).
pub fn preflight(config: &RunConfig) -> Result<(Vec<DeviceSpec>, Option<Plan>)> {
    let slots = config.device_slots();
    let devices =
        parse_slots(&slots).map_err(|message| Error::Device { device: slots.join(","), message })?;
    for device in &devices {
        device.check_available()?;
    }
    let teacher = teacher_specs(config);
    let students = student_specs(&config.students, &teacher)?;
    for (k, student) in config.students.iter().enumerate() {
        crate::zoo::check_teacher_init(k, student)?;
    }
    let plan = match config.schedule()? {
        Schedule::Auto => None,
        _ => Some(plan_for(config, &teacher, &students, devices.len())?),
    };
    check_inputs(config)?;
    Ok((devices, plan))
}

/// Checks that the files a config names are there and what they should be,
/// without reading what training reads: the MNIST files' headers and sizes
/// and the MNIST teacher's weights (loaded on the CPU: 1.5 MB), or the
/// Brown corpus' file list, the probe's folder, MiniLM's safetensors header and its
/// tokenizer. Every error names the file.
pub fn check_inputs(config: &RunConfig) -> Result<()> {
    let data = &config.data;
    if !data.is_text() {
        crate::data::check_mnist_files(&data.dir)?;
        pipebd_teachers::mnist_cnn::MnistCnn::<burn::backend::Flex>::load_pytorch(
            &config.teacher.weights,
            &Default::default(),
        )?;
        return Ok(());
    }
    crate::data::text::brown_files(&data.dir)?;
    if let Some(probe) = &data.probe {
        if !probe.dir.is_dir() {
            return Err(crate::data::data_error(
                &probe.dir,
                "folder not found (run scripts/setup-data.sh, or fix `data.probe.dir` in the config)",
            ));
        }
    }
    check_safetensors_header(&config.teacher.weights)?;
    pipebd_teachers::minilm::MiniLmTokenizer::load(&config.teacher.tokenizer_path())?;
    Ok(())
}

/// Checks that `path` is laid out as a safetensors file (an 8-byte header
/// length, a JSON header, tensor data up to the last offset it announces)
/// without reading the tensors.
fn check_safetensors_header(path: &Path) -> Result<()> {
    use pipebd_teachers::TeacherError;
    use std::io::Read;
    let bad =
        |message: String| Error::Teacher(TeacherError::BadWeights { path: path.to_path_buf(), message });
    if path.is_dir() {
        return Err(bad("is a folder, expected the `model.safetensors` file".into()));
    }
    if !path.is_file() {
        return Err(Error::Teacher(TeacherError::MissingWeights { path: path.to_path_buf() }));
    }
    let mut file = std::fs::File::open(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let size = file.metadata().map_err(|e| bad(format!("cannot read: {e}")))?.len();
    let not_safetensors = |what: String| bad(format!("not a safetensors file: {what}"));
    let mut word = [0u8; 8];
    file.read_exact(&mut word)
        .map_err(|_| not_safetensors(format!("{size} bytes, too short for the header length")))?;
    let header_len = u64::from_le_bytes(word);
    if header_len > size.saturating_sub(8) {
        return Err(not_safetensors(format!(
            "the header length {header_len} exceeds the file's {size} bytes"
        )));
    }
    let mut header = Vec::new();
    file.take(header_len).read_to_end(&mut header).map_err(|e| bad(format!("cannot read: {e}")))?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| not_safetensors(format!("the header is not a JSON object ({e})")))?;
    let tensors: Vec<&serde_json::Value> =
        header.iter().filter(|(name, _)| name.as_str() != "__metadata__").map(|(_, t)| t).collect();
    if tensors.is_empty() {
        return Err(not_safetensors("the header lists no tensors".into()));
    }
    let data_end =
        tensors.iter().filter_map(|tensor| tensor.get("data_offsets")?.get(1)?.as_u64()).max().unwrap_or(0);
    let needed = header_len.saturating_add(data_end).saturating_add(8);
    if needed > size {
        return Err(bad(format!("truncated: the tensors end at byte {needed}, the file has {size}")));
    }
    Ok(())
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
