//! Times the AHD planner on large synthetic cost tables (W = 64, K = 48).
//! `cargo bench --bench planner` prints the timings; nothing is asserted.

use std::time::Instant;

use pipe_bd::planning::planner::{plan, CostTable};

fn table(blocks: usize, slots: usize) -> CostTable {
    let cost = |k: usize, g: usize, base: f64| Some(base * (1.0 + (k % 7) as f64) / g as f64);
    CostTable {
        teacher_forward: (0..blocks).map(|k| (1..=slots).map(|g| cost(k, g, 1.0)).collect()).collect(),
        student_step: (0..blocks).map(|k| (1..=slots).map(|g| cost(k, g, 2.0)).collect()).collect(),
        gradient_average: (0..blocks).map(|_| (1..=slots).map(|g| 0.01 * (g - 1) as f64).collect()).collect(),
        input_transfer: (0..blocks).map(|_| (1..=slots).map(|g| 0.05 / g as f64).collect()).collect(),
        memory: (0..blocks)
            .map(|k| (1..=slots).map(|g| Some((100 + k as u64 * 10) / g as u64 + 1)).collect())
            .collect(),
        update: (0..blocks)
            .map(|k| (1..=slots).map(|g| 0.1 * cost(k, g, 1.0).unwrap_or(0.0)).collect())
            .collect(),
    }
}

fn main() {
    for (blocks, slots) in [(6, 4), (16, 8), (48, 16), (48, 64)] {
        let costs = table(blocks, slots);
        let start = Instant::now();
        let plans = plan(&costs, slots, Some(400), 5);
        let elapsed = start.elapsed();
        println!(
            "planner K={blocks:>2} W={slots:>2}: {:>8.2} ms, best {} ({:.3} per step)",
            elapsed.as_secs_f64() * 1e3,
            plans.first().map_or("none".into(), |p| p.describe()),
            plans.first().map_or(f64::NAN, |p| p.step_seconds)
        );
    }
}
