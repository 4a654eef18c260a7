//! burn's wgpu backend (Mesa's software Vulkan where there is no GPU): our
//! CubeCL kernels against burn's ops, and the whole distillation, where the
//! teacher's and the students' convolutions, pools, linear layers, losses and
//! optimizer steps run as those kernels: it must end where the CPU (flex)
//! run ends, reading values back only at its logged steps.
#![cfg(feature = "wgpu")]

use std::path::Path;

use pipebd_cli::config::RunConfig;

use crate::common;

#[test]
fn wgpu_run_matches_the_cpu_run() {
    let text = common::small_config(3000, 1000, 1)
        .replace("batch_size = 64", "batch_size = 32")
        .replace("log_every = 1", "log_every = 25");
    let run = |device: &str| {
        let mut config = RunConfig::parse(&text, Path::new("small.toml")).unwrap();
        config.device = device.to_string();
        let out = tempfile::tempdir().unwrap();
        pipebd_zoo::run_builtin(&config, out.path(), &Default::default(), &mut |_| {}).unwrap()
    };
    let cpu = run("cpu");
    let gpu = run("wgpu");
    eprintln!(
        "cpu: accuracy {} losses {:?}\nwgpu: accuracy {} losses {:?}",
        cpu.student_accuracy,
        cpu.blocks.iter().map(|b| b.final_loss).collect::<Vec<_>>(),
        gpu.student_accuracy,
        gpu.blocks.iter().map(|b| b.final_loss).collect::<Vec<_>>()
    );
    assert_eq!(cpu.steps, gpu.steps);
    for (c, g) in cpu.blocks.iter().zip(&gpu.blocks) {
        let relative = (c.final_loss - g.final_loss).abs() / c.final_loss.abs().max(1e-12);
        assert!(relative < 0.02, "block {}: cpu loss {} vs wgpu {}", c.block, c.final_loss, g.final_loss);
    }
    let points = 100.0 * (cpu.student_accuracy - gpu.student_accuracy).abs();
    assert!(points <= 0.5, "student accuracy cpu {} vs wgpu {}", cpu.student_accuracy, gpu.student_accuracy);
    assert!(gpu.student_accuracy > 0.5, "the wgpu student learned: {}", gpu.student_accuracy);

    // The CPU reads every block's loss at every step; on wgpu the losses
    // stay on the device and the worker reads them once per logged step
    // (steps 0, 25, 50, 75 and the last), plus once per block for the
    // loss window of its final checkpoint.
    let blocks = cpu.blocks.len();
    let logged = cpu.steps.div_ceil(25) + usize::from((cpu.steps - 1) % 25 != 0);
    assert_eq!(cpu.host_reads, cpu.steps * blocks, "the CPU run's reads");
    assert!(
        gpu.host_reads >= logged && gpu.host_reads <= logged + blocks,
        "{} reads back on wgpu in {} steps ({logged} logged)",
        gpu.host_reads,
        gpu.steps
    );
}

/// Our CubeCL kernels on wgpu: every fused op, forward and every gradient,
/// against burn's unfused ops on the same device, on fresh random inputs of
/// awkward sizes, every kernel output filled with NaN before the launch
/// (`pipebd kernels --device wgpu --check`). It lives here rather than in
/// the kernels crate: the engine library already compiles this check for
/// wgpu, and a test binary of its own would compile all of burn's wgpu ops
/// once more (about 4 minutes of a cold build).
#[test]
fn kernels_match_burn_ops_on_wgpu() {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let report = pipebd_cli::jobs::kernels::kernels("wgpu", Some(seed), None).unwrap();
    let rows = &report.checks;
    assert!(rows.len() > 100, "{} rows", rows.len());
    assert!(rows.iter().all(|r| r.passed()), "seed {seed}:\n{}", pipebd_kernels::check::table(rows));
}

/// The decoder path on wgpu: SmolLM2's 30 layers as the teacher, a pruned
/// layer, a skipped block and an FFN-only layer as students, then the
/// stitched pass on the head's KL. RMSNorm, the rotary grouped-query
/// attention, SwiGLU and the KL run as our CubeCL kernels; the block
/// losses, the stitched KL and the student's perplexity must match the CPU
/// run's.
#[test]
fn a_decoder_run_on_wgpu_ends_where_the_cpu_run_ends() {
    let dir = tempfile::tempdir().unwrap();
    let config = crate::smollm2::stitched_decoder_config(dir.path());
    let text = std::fs::read_to_string(&config).unwrap();
    let run = |device: &str| {
        let text = text
            .replace("devices = [\"cpu\", \"cpu\"]", &format!("device = \"{device}\""))
            .replace("schedule = \"tr-dpu\"", "schedule = \"ideal\"");
        assert!(text.contains(&format!("device = \"{device}\"")), "{text}");
        let path = dir.path().join(format!("{device}.toml"));
        std::fs::write(&path, text).unwrap();
        let out = dir.path().join(device);
        let (code, stdout, stderr) =
            common::pipebd(&["run", path.to_str().unwrap(), "--out", out.to_str().unwrap(), "--quiet"]);
        assert_eq!(code, 0, "{device}: {stdout}\n{stderr}");
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
        report
    };
    let cpu = run("cpu");
    let gpu = run("wgpu");
    let close = |what: &str, a: &serde_json::Value, b: &serde_json::Value, tolerance: f64| {
        let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
        let relative = (a - b).abs() / a.abs().max(1e-12);
        assert!(relative < tolerance, "{what}: cpu {a} vs wgpu {b} ({relative:.2e} apart)");
    };
    let blocks = cpu["blocks"].as_array().unwrap();
    assert_eq!(blocks.len(), 3);
    for (k, (c, g)) in blocks.iter().zip(gpu["blocks"].as_array().unwrap()).enumerate() {
        if c["final_loss"].is_null() {
            continue; // the skipped block trains nothing
        }
        close(&format!("block {} loss", k + 1), &c["final_loss"], &g["final_loss"], 0.02);
    }
    close(
        "stitched head KL",
        &cpu["stitched"]["final_output_loss"],
        &gpu["stitched"]["final_output_loss"],
        0.02,
    );
    close(
        "student perplexity",
        &cpu["language"]["student_perplexity"],
        &gpu["language"]["student_perplexity"],
        0.01,
    );
    close(
        "teacher perplexity",
        &cpu["language"]["teacher_perplexity"],
        &gpu["language"]["teacher_perplexity"],
        0.001,
    );
}
