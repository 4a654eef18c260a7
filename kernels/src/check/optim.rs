//! The optimizer update in the check ([`super::run`]): the backend's
//! update of a whole block against burn's own `Adam` and `Sgd`, one tensor
//! at a time, on the CPU.

use burn::tensor::{Tensor, TensorData};
use rand::rngs::StdRng;

use super::common::{floats, random, CheckRow, Rows, OPTIMIZER_TOLERANCE};
use crate::DistillBackend;

/// Steps of the optimizer checks.
const OPTIMIZER_STEPS: usize = 20;

/// The backend's optimizer update ([`crate::FusedBackend::optimizer_step`],
/// every tensor of a block in one call) against burn's own `Adam` and `Sgd`
/// on the CPU, one tensor at a time: 20 steps on the same random gradients
/// with a learning rate that changes every step (it travels as data), then
/// the parameters and the optimizer state compared.
pub(super) fn check_optimizers<B: DistillBackend>(
    out: &mut Vec<CheckRow>,
    rng: &mut StdRng,
    device: &B::Device,
) {
    use crate::optim::{AdamRule, SgdMomentum, SgdRule, UpdateRule};
    let shapes: [&[usize]; 5] = [&[37], &[5, 13], &[16, 8, 3, 3], &[1], &[128, 1152]];
    let adam = |beta_1, beta_2, epsilon, weight_decay| {
        UpdateRule::Adam(AdamRule { beta_1, beta_2, epsilon, weight_decay })
    };
    let sgd = |nesterov, dampening, weight_decay| {
        UpdateRule::Sgd(SgdRule {
            momentum: Some(SgdMomentum { momentum: 0.9, dampening, nesterov }),
            weight_decay,
        })
    };
    let rules = [
        ("adam", adam(0.9, 0.999, 1e-5, None)),
        ("adam decay", adam(0.8, 0.99, 1e-8, Some(0.01))),
        ("sgd nesterov", sgd(true, 0.0, Some(0.001))),
        ("sgd damped", sgd(false, 0.1, None)),
        ("sgd plain", UpdateRule::Sgd(SgdRule { momentum: None, weight_decay: None })),
    ];
    for (name, rule) in rules {
        let params: Vec<TensorData> = shapes.iter().map(|shape| random(rng, shape, 1.0)).collect();
        let steps: Vec<Vec<TensorData>> = (0..OPTIMIZER_STEPS)
            .map(|_| shapes.iter().map(|shape| random(rng, shape, 0.1)).collect())
            .collect();
        let lrs: Vec<f64> =
            (0..OPTIMIZER_STEPS).map(|i| 0.01 * (1.0 + (i as f64 * 0.3).cos()) / 2.0 + 1e-4).collect();
        let fused = fused_updates::<B::InnerBackend>(&params, &steps, &lrs, &rule, device);
        let reference = burn_updates(&params, &steps, &lrs, &rule);
        let mut rows = Rows {
            rows: vec![],
            op: "optimizer",
            case: format!("{name}, 5 tensors, {OPTIMIZER_STEPS} steps"),
            tolerance: OPTIMIZER_TOLERANCE,
        };
        let flat = |v: &[Vec<f32>]| v.concat();
        rows.add("param", &flat(&fused.0), &flat(&reference.0));
        if !reference.1.is_empty() {
            rows.add("state", &flat(&fused.1), &flat(&reference.1));
        }
        out.extend(rows.rows);
    }
}

/// Parameters and state (first moments or velocities, then second moments)
/// after every step through the backend's own update.
fn fused_updates<B: crate::FusedBackend>(
    params: &[TensorData],
    steps: &[Vec<TensorData>],
    lrs: &[f64],
    rule: &crate::UpdateRule,
    device: &B::Device,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    use crate::optim::ParamSlot;
    let primitive = |data: &TensorData| B::float_from_data(data.clone(), device);
    let mut current: Vec<_> = params.iter().map(|p| (primitive(p), None)).collect();
    for (grads, &lr) in steps.iter().zip(lrs) {
        let slots = current
            .into_iter()
            .zip(grads)
            .map(|((param, state), grad)| ParamSlot { param, grad: primitive(grad), state })
            .collect();
        current = B::optimizer_step(slots, rule, lr).into_iter().map(|u| (u.param, u.state)).collect();
    }
    let read = |t: burn::tensor::ops::FloatTensor<B>| {
        Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(B::float_reshape(
            t.clone(),
            [burn::tensor::TensorMetadata::shape(&t).num_elements()].into(),
        )))
        .into_data()
        .to_vec::<f32>()
        .unwrap_or_default()
    };
    let mut state = Vec::new();
    let mut second = Vec::new();
    let values = current
        .into_iter()
        .map(|(param, s)| {
            if let Some(s) = s {
                state.push(read(s.first));
                if let Some(v) = s.second {
                    second.push(read(v));
                }
            }
            read(param)
        })
        .collect();
    state.extend(second);
    (values, state)
}

/// The same through burn's `Adam` / `Sgd` (`SimpleOptimizer::step`, one
/// flattened tensor at a time) on the CPU.
fn burn_updates(
    params: &[TensorData],
    steps: &[Vec<TensorData>],
    lrs: &[f64],
    rule: &crate::UpdateRule,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    use burn::optim::decay::WeightDecayConfig;
    use burn::optim::momentum::MomentumConfig;
    use burn::optim::{AdamConfig, SgdConfig, SimpleOptimizer};
    type Cpu = burn::backend::Flex;
    let device = Default::default();
    let flat = |data: &TensorData| {
        let values = floats(data);
        let n = values.len();
        Tensor::<Cpu, 1>::from_data(TensorData::new(values, [n]), &device)
    };
    let vec = |t: Tensor<Cpu, 1>| t.into_data().to_vec::<f32>().unwrap_or_default();
    let mut values = Vec::new();
    let mut firsts = Vec::new();
    let mut seconds = Vec::new();
    for (k, param) in params.iter().enumerate() {
        let mut tensor = flat(param);
        match rule {
            crate::UpdateRule::Adam(a) => {
                let mut config =
                    AdamConfig::new().with_beta_1(a.beta_1).with_beta_2(a.beta_2).with_epsilon(a.epsilon);
                if let Some(p) = a.weight_decay {
                    config = config.with_weight_decay(Some(WeightDecayConfig::new(p)));
                }
                let adam = config.build();
                let mut state = None;
                for (grads, &lr) in steps.iter().zip(lrs) {
                    let (t, s) = adam.step(lr, tensor, flat(&grads[k]), state);
                    (tensor, state) = (t, s);
                }
                if let Some(state) = state {
                    firsts.push(vec(state.momentum.moment_1));
                    seconds.push(vec(state.momentum.moment_2));
                }
            }
            crate::UpdateRule::Sgd(s) => {
                let momentum = s.momentum.map(|m| MomentumConfig {
                    momentum: m.momentum,
                    dampening: m.dampening,
                    nesterov: m.nesterov,
                });
                let config = SgdConfig::new()
                    .with_momentum(momentum)
                    .with_weight_decay(s.weight_decay.map(WeightDecayConfig::new));
                let sgd = config.build::<Cpu>();
                let mut state = None;
                for (grads, &lr) in steps.iter().zip(lrs) {
                    let (t, st) = sgd.step(lr, tensor, flat(&grads[k]), state);
                    (tensor, state) = (t, st);
                }
                // burn's velocity is private to its record: read it through the record's item.
                if let Some(velocity) = state.and_then(|s| s.momentum) {
                    use burn::record::{FullPrecisionSettings, Record};
                    let item = Record::<Cpu>::into_item::<FullPrecisionSettings>(velocity);
                    let velocity = <Tensor<Cpu, 1> as Record<Cpu>>::from_item::<FullPrecisionSettings>(
                        item.velocity,
                        &device,
                    );
                    firsts.push(vec(velocity));
                }
            }
        }
        values.push(vec(tensor));
    }
    firsts.extend(seconds);
    (values, firsts)
}
