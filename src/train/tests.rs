//! Unit tests of block training.

mod block_trainer {
    use burn::backend::{Autodiff, Flex};
    use burn::module::{AutodiffModule, Module};
    use burn::tensor::{Distribution, Tensor};
    use pipebd_core::{flat_parameters, Activation, Block, BlockSpec};
    use pipebd_students::{Downsample, StudentBlock, StudentBlockConfig};

    use crate::train::arch::{sample_path, softmax, Draw, SinglePath};
    use crate::train::{BlockTrainer, TrainSettings};

    type B = Autodiff<Flex>;

    /// A supernet of two convolutions and a separable block for a [2, 6, 6] input.
    fn supernet() -> StudentBlock<B> {
        let device = Default::default();
        let conv = |width| StudentBlockConfig::Conv { width, out_channels: 4, downsample: Downsample::Pool };
        let separable = StudentBlockConfig::Separable {
            out_channels: 4,
            depth_multiplier: 2,
            inner_relu: true,
            downsample: Downsample::Pool,
        };
        let set = StudentBlockConfig::Candidates { candidates: vec![conv(3), conv(2), separable] };
        let module = set.init::<B>(1, &[2, 6, 6], &device).unwrap().module;
        // Draw the lazily initialised parameters once.
        module.clone().load_record(module.into_record())
    }

    fn trainer(module: StudentBlock<B>, seed: u64) -> BlockTrainer<B, StudentBlock<B>> {
        let spec = BlockSpec::infer("supernet", &module, &[2, 6, 6], &Default::default()).unwrap();
        let settings = TrainSettings {
            seed,
            single_path: Some(SinglePath { arch_every: 1, warmup: 0.0, arch_lr: 0.05 }),
            ..Default::default()
        };
        BlockTrainer::new(0, spec, module, &settings.optimizer, 100).configured(&settings)
    }

    fn batch() -> (Activation<Flex>, Activation<Flex>) {
        let device = Default::default();
        let x = Tensor::<Flex, 4>::random([5, 2, 6, 6], Distribution::Default, &device);
        let y = Tensor::<Flex, 4>::random([5, 4, 3, 3], Distribution::Default, &device);
        (Activation::Maps(x), Activation::Maps(y))
    }

    fn alpha(trainer: &BlockTrainer<B, StudentBlock<B>>) -> Vec<f32> {
        trainer.module().unwrap().arch_logits().unwrap().into_data().iter::<f32>().collect()
    }

    fn candidate_weights(trainer: &BlockTrainer<B, StudentBlock<B>>) -> Vec<Vec<f32>> {
        trainer.module().unwrap().candidates().iter().map(flat_parameters::<B, _>).collect()
    }

    #[test]
    fn a_training_step_trains_the_sampled_candidate_and_never_alpha() {
        // Seeded weights and batches (unseeded, a candidate could start with
        // every unit dead and not move): burn's generator held throughout.
        let _rng = crate::rng::burn_rng_lock();
        <Flex as burn::tensor::backend::Backend>::seed(&Default::default(), 3);
        let mut trainer = trainer(supernet(), 11);
        assert!(trainer.searches_paths());
        for step in 0..6 {
            let before = candidate_weights(&trainer);
            let alpha_before = alpha(&trainer);
            let path = sample_path(11, 0, step, Draw::Train, &softmax(&alpha_before));
            let (x, y) = batch();
            trainer.step(x, y).unwrap();
            let after = candidate_weights(&trainer);
            assert_eq!(alpha(&trainer), alpha_before, "step {step}: a training step moved alpha");
            for (c, (b, a)) in before.iter().zip(&after).enumerate() {
                if c == path {
                    assert_ne!(b, a, "step {step}: the sampled candidate {c} did not train");
                } else {
                    assert_eq!(b, a, "step {step}: candidate {c} trained but {path} was sampled");
                }
            }
        }
        assert_eq!(trainer.step, 6);
    }

    #[test]
    fn an_architecture_step_moves_alpha_only_by_the_proxylessnas_gradient() {
        let mut trainer = trainer(supernet(), 5);
        let (x, y) = batch();
        let weights = candidate_weights(&trainer);
        let logits = alpha(&trainer);
        let p = softmax(&logits);
        let (loss, grads) = trainer.compute_arch_grads(x.clone(), y.clone(), 1.0).unwrap();
        let loss = loss.value();

        // By hand: out = o_path, L = mean((out - y)^2), dL/dg_j = <dL/dout, o_j>,
        // dL/dalpha_i = sum_j dL/dg_j p_j (delta_ij - p_i).
        let path = sample_path(5, 0, 0, Draw::Arch, &p);
        let module = trainer.module().unwrap().valid();
        let flat = |a: Activation<Flex>| -> Vec<f64> {
            let Activation::Maps(t) = a else { panic!() };
            t.into_data().iter::<f32>().map(f64::from).collect()
        };
        let outputs: Vec<Vec<f64>> =
            module.candidates().iter().map(|c| flat(c.forward(x.clone()).unwrap())).collect();
        let target = flat(y);
        let n = target.len() as f64;
        let d_out: Vec<f64> = outputs[path].iter().zip(&target).map(|(o, t)| 2.0 * (o - t) / n).collect();
        let expected_loss: f64 =
            outputs[path].iter().zip(&target).map(|(o, t)| (o - t).powi(2)).sum::<f64>() / n;
        assert!((loss as f64 - expected_loss).abs() <= 1e-5 * expected_loss, "{loss} vs {expected_loss}");
        let d_gate: Vec<f64> =
            outputs.iter().map(|o| o.iter().zip(&d_out).map(|(a, b)| a * b).sum()).collect();
        let expected: Vec<f64> = (0..p.len())
            .map(|i| (0..p.len()).map(|j| d_gate[j] * p[j] * (if i == j { 1.0 } else { 0.0 } - p[i])).sum())
            .collect();
        let StudentBlock::Candidates(set) = trainer.module().unwrap() else { panic!() };
        let grad: Vec<f64> =
            grads.get::<Flex, 1>(set.alpha.id).unwrap().into_data().iter::<f32>().map(f64::from).collect();
        // The gradients sum to zero (softmax): compare against their scale.
        let scale = expected.iter().fold(0.0f64, |m, e| m.max(e.abs()));
        assert!(scale > 0.0, "a zero architecture gradient");
        for (g, e) in grad.iter().zip(&expected) {
            assert!((g - e).abs() <= 1e-3 * scale, "alpha gradient {grad:?}, by hand {expected:?}");
        }

        trainer.apply_arch(vec![grads]).unwrap();
        assert_eq!(candidate_weights(&trainer), weights, "an architecture step moved a candidate's weights");
        assert_ne!(alpha(&trainer), logits, "the architecture step did not move alpha");
        assert_eq!(trainer.step, 0, "architecture steps are not training steps");
        // Adam with beta1 = 0: the first step moves each logit by lr * sign(gradient).
        // (Up to epsilon 1e-8 against |gradient|: checked where that is negligible.)
        for ((after, before), g) in alpha(&trainer).iter().zip(&logits).zip(&grad) {
            let moved = (after - before) as f64;
            if g.abs() > 1e-5 {
                assert!((moved + 0.05 * g.signum()).abs() <= 1e-4, "moved {moved} for gradient {g}");
            }
        }
    }

    #[test]
    fn the_architecture_state_survives_a_checkpoint() {
        let mut trainer = trainer(supernet(), 5);
        for _ in 0..2 {
            let (x, y) = batch();
            let (_, grads) = trainer.compute_arch_grads(x, y, 1.0).unwrap();
            trainer.apply_arch(vec![grads]).unwrap();
        }
        let state = trainer.save_state().unwrap();
        assert!(state.arch_optimizer.is_some());
        let mut restored = self::trainer(supernet(), 5);
        restored.load_state(state, &Default::default()).unwrap();
        assert_eq!(alpha(&restored), alpha(&trainer));
        // The next architecture step is the same from both.
        let (x, y) = batch();
        for t in [&mut trainer, &mut restored] {
            let (_, grads) = t.compute_arch_grads(x.clone(), y.clone(), 1.0).unwrap();
            t.apply_arch(vec![grads]).unwrap();
        }
        assert_eq!(alpha(&restored), alpha(&trainer));
        // Without the architecture optimizer's state the resume is refused.
        let mut state = trainer.save_state().unwrap();
        state.arch_optimizer = None;
        let error = self::trainer(supernet(), 5).load_state(state, &Default::default()).unwrap_err();
        assert!(error.contains("arch.mpk"), "{error}");
    }
}

/// The loss bookkeeping on an asynchronous device (wgpu; Mesa's software
/// Vulkan driver where there is no GPU).
#[cfg(all(test, feature = "wgpu"))]
mod async_device_tests {
    use burn::backend::wgpu::WgpuDevice;
    use burn::backend::Autodiff;
    use burn::tensor::{Distribution, Tensor};
    use pipebd_core::{Activation, BlockSpec};
    use pipebd_students::{Downsample, StudentBlock, StudentBlockConfig};

    use crate::device::host_reads_on_this_thread;
    use crate::train::{read_losses, BlockTrainer, OptimizerConfig};

    type Wgpu = pipebd_kernels::Wgpu;
    type W = Autodiff<Wgpu>;

    /// Six steps with no read back, then one read at the logged step: it
    /// finds the NaN that the third step's input brought and names that
    /// step, not the one it was read at.
    #[test]
    fn losses_stay_on_the_device_until_a_logged_step_which_names_the_step_that_diverged() {
        let device = WgpuDevice::DefaultDevice;
        let config = StudentBlockConfig::Conv { width: 3, out_channels: 4, downsample: Downsample::Pool };
        let module: StudentBlock<W> = config.init::<W>(1, &[2, 6, 6], &device).unwrap().module;
        let spec = BlockSpec::infer("conv", &module, &[2, 6, 6], &device).unwrap();
        let mut trainer = BlockTrainer::new(1, spec, module, &OptimizerConfig::default(), 100);
        let batch = |scale: f32| {
            let x = Tensor::<Wgpu, 4>::random([5, 2, 6, 6], Distribution::Default, &device).mul_scalar(scale);
            let y = Tensor::<Wgpu, 4>::random([5, 4, 3, 3], Distribution::Default, &device);
            (Activation::Maps(x), Activation::Maps(y))
        };
        let reads = host_reads_on_this_thread();
        for step in 0..6 {
            let (x, y) = batch(if step == 2 { f32::NAN } else { 1.0 });
            let (loss, grads) = trainer.compute_grads(x, y, 1.0).unwrap();
            trainer.apply(vec![grads], loss).unwrap();
            assert_eq!(trainer.latest_loss(), None, "step {step}'s loss was read back before a logged step");
        }
        assert_eq!(host_reads_on_this_thread(), reads, "values were read back during the steps");
        let error = read_losses(&mut [&mut trainer]).unwrap_err().to_string();
        assert!(host_reads_on_this_thread() > reads);
        assert!(
            error.contains("block 2")
                && error.contains("step 2")
                && error.contains("NaN")
                && error.contains("after step 5"),
            "{error}"
        );
    }

    /// A healthy run reads back once per logged step, and the reported
    /// final loss is the mean of the last steps' losses, all of them.
    #[test]
    fn a_logged_step_reads_its_loss_and_the_window_reads_the_rest() {
        let device = WgpuDevice::DefaultDevice;
        let config = StudentBlockConfig::Conv { width: 3, out_channels: 4, downsample: Downsample::Pool };
        let module: StudentBlock<W> = config.init::<W>(1, &[2, 6, 6], &device).unwrap().module;
        let spec = BlockSpec::infer("conv", &module, &[2, 6, 6], &device).unwrap();
        let mut trainer = BlockTrainer::new(0, spec, module, &OptimizerConfig::default(), 100);
        let x = Tensor::<Wgpu, 4>::random([5, 2, 6, 6], Distribution::Default, &device);
        let y = Tensor::<Wgpu, 4>::random([5, 4, 3, 3], Distribution::Default, &device);
        let mut values = Vec::new();
        for step in 0..30 {
            let (loss, grads) =
                trainer.compute_grads(Activation::Maps(x.clone()), Activation::Maps(y.clone()), 1.0).unwrap();
            values.push(loss.value());
            trainer.apply(vec![grads], loss).unwrap();
            if step % 10 == 0 {
                read_losses(&mut [&mut trainer]).unwrap();
                assert_eq!(trainer.latest_loss(), Some(values[step]));
            }
        }
        let last: Vec<f32> = values[values.len() - crate::train::FINAL_LOSS_WINDOW..].to_vec();
        let mean = last.iter().sum::<f32>() / last.len() as f32;
        assert_eq!(trainer.recent_loss(), mean);
        assert!(values[29] < values[0], "the block did not learn: {values:?}");
    }
}
