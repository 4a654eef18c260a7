//! Which random generator draws a run's initial student weights and its
//! epoch orders: pipe-bd's own, or PyTorch's.
//!
//! With [`Generator::Torch`], a run starts where a PyTorch script starts after
//! `torch.manual_seed(seed)`: each student's `Conv2d` and `Linear` parameters
//! are drawn as `torch.nn` draws them (Kaiming-uniform weights with
//! `a = sqrt(5)`, biases uniform in `±1/sqrt(fan_in)`), block after block, in
//! the order the layers are declared, from PyTorch's CPU generator (MT19937
//! with its float transform), and each epoch's order is the next
//! `torch.randperm(len)` of the same stream. The students and the batches are
//! then bit-identical to the script's: what is left to compare is the training
//! itself (`bench/peers/` does).

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand_mt::Mt;
use serde::{Deserialize, Serialize};

/// Holds burn's process-wide random generator for the caller.
///
/// burn's CPU backend draws every random tensor of the process (module
/// initialisers among them, lazily, at a parameter's first use) from one
/// generator. Hold this guard from seeding it to the last draw, as the
/// built-in zoo does when it builds students, so that modules built on other
/// threads at the same time neither take draws from your sequence nor leave
/// theirs in it: a seed then gives the same weights however many runs, checks
/// or tests share the process. A `Zoo` (crate `pipebd-cli`) of your own that
/// seeds and builds in `students` should hold it there too. Not reentrant:
/// do not call back into the built-in zoo while holding it.
pub fn burn_rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static BURN_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    BURN_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The generator of a run's initial weights and epoch orders (config key
/// `generator`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Generator {
    /// burn's generator for the weights (each module's own initialiser) and a
    /// seeded shuffle per epoch: the default.
    #[default]
    Native,
    /// PyTorch's CPU generator, as after `torch.manual_seed(seed)`: students
    /// built of `Conv2d` and `Linear` layers only.
    Torch,
}

/// PyTorch's CPU generator: MT19937 seeded as `torch.manual_seed` seeds it
/// (the seed's low 32 bits), with PyTorch's transforms of its 32-bit draws.
pub struct TorchRng {
    mt: Mt,
    draws: u64,
}

impl TorchRng {
    /// The generator after `torch.manual_seed(seed)`.
    pub fn new(seed: u64) -> Self {
        Self { mt: Mt::new(seed as u32), draws: 0 }
    }

    /// How many 32-bit draws have been taken.
    pub fn draws(&self) -> u64 {
        self.draws
    }

    /// Skips `n` draws.
    pub fn skip(&mut self, n: u64) {
        for _ in 0..n {
            self.next_u32();
        }
    }

    fn next_u32(&mut self) -> u32 {
        self.draws += 1;
        self.mt.next_u32()
    }

    /// One `float32` of `tensor.uniform_(low, high)`: 24 random bits scaled
    /// to `[0, 1)`, then `u * (high - low) + low` in one fused multiply-add,
    /// all in single precision, as PyTorch computes it on the CPU.
    pub fn uniform(&mut self, low: f64, high: f64) -> f32 {
        let (low, high) = (low as f32, high as f32);
        let unit = (self.next_u32() & ((1 << 24) - 1)) as f32 * (1.0 / (1u32 << 24) as f32);
        unit.mul_add(high - low, low)
    }

    /// `torch.randperm(n)` on the CPU: a Fisher-Yates pass that swaps
    /// position `i` with `i + draw % (n - i)`.
    pub fn randperm(&mut self, n: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..n).collect();
        for i in 0..n.saturating_sub(1) {
            let z = (self.next_u32() as u64 % (n - i) as u64) as usize;
            order.swap(i, i + z);
        }
        order
    }
}

/// The bound of `torch.nn.init.kaiming_uniform_(w, a=sqrt(5))` for `fan_in`,
/// computed in double precision as `torch.nn.init` computes it.
fn kaiming_bound(fan_in: usize) -> f64 {
    let a = 5f64.sqrt();
    let gain = (2.0 / (1.0 + a * a)).sqrt();
    let std = gain / (fan_in as f64).sqrt();
    3f64.sqrt() * std
}

/// Redraws every parameter of `module` as `torch.nn` would have initialised
/// the same layers built in the same order, from `rng`. Returns an error
/// naming the first parameter that is not a `Conv2d` or `Linear` weight or
/// bias (PyTorch initialises other layers differently, e.g. `LayerNorm`).
/// A supernet's architecture logits (a parameter named `alpha`) keep their
/// values and draw nothing: a PyTorch supernet starts them at zero.
///
/// burn keeps a linear weight as `[in, out]`, PyTorch as `[out, in]`: it is
/// drawn in PyTorch's order and transposed.
pub fn init_like_torch<B: Backend, M: Module<B>>(module: M, rng: &mut TorchRng) -> Result<M, String> {
    let mut mapper = TorchInit { rng, path: Vec::new(), fan_in: None, error: None };
    let module = module.map(&mut mapper);
    match mapper.error {
        Some(error) => Err(error),
        None => Ok(module),
    }
}

struct TorchInit<'a> {
    rng: &'a mut TorchRng,
    /// (field name, container type) of the modules entered.
    path: Vec<(String, String)>,
    /// The fan-in of the last weight drawn, for the bias after it.
    fan_in: Option<usize>,
    error: Option<String>,
}

impl TorchInit<'_> {
    fn layer(&self) -> &str {
        self.path.last().map(|(_, kind)| kind.trim_start_matches("Struct:")).unwrap_or("")
    }

    fn where_(&self) -> String {
        let names: Vec<&str> = self.path.iter().map(|(name, _)| name.as_str()).collect();
        if names.is_empty() {
            "the module itself".into()
        } else {
            names.join(".")
        }
    }

    /// The values of a parameter of `shape`, in burn's layout, or why not.
    fn draw(&mut self, shape: &[usize]) -> Result<Vec<f32>, String> {
        let layer = self.layer().to_string();
        match (layer.as_str(), shape) {
            ("Conv2d", [_, per_group, kh, kw]) => {
                let fan_in = per_group * kh * kw;
                self.fan_in = Some(fan_in);
                let bound = kaiming_bound(fan_in);
                Ok((0..shape.iter().product::<usize>()).map(|_| self.rng.uniform(-bound, bound)).collect())
            }
            ("Linear", [d_in, d_out]) => {
                let (d_in, d_out) = (*d_in, *d_out);
                self.fan_in = Some(d_in);
                let bound = kaiming_bound(d_in);
                let torch_order: Vec<f32> =
                    (0..d_in * d_out).map(|_| self.rng.uniform(-bound, bound)).collect();
                let mut burn_order = vec![0.0; d_in * d_out];
                for o in 0..d_out {
                    for i in 0..d_in {
                        burn_order[i * d_out + o] = torch_order[o * d_in + i];
                    }
                }
                Ok(burn_order)
            }
            ("Conv2d" | "Linear", [n]) => {
                let fan_in = self
                    .fan_in
                    .take()
                    .ok_or_else(|| format!("{}: a bias before its weight", self.where_()))?;
                let bound = 1.0 / (fan_in as f64).sqrt();
                Ok((0..*n).map(|_| self.rng.uniform(-bound, bound)).collect())
            }
            _ => Err(format!(
                "{} ({}, shape {shape:?}): generator = \"torch\" draws Conv2d and Linear parameters only",
                self.where_(),
                if layer.is_empty() { "no layer" } else { layer.as_str() },
            )),
        }
    }
}

impl<B: Backend> ModuleMapper<B> for TorchInit<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.push((name.to_string(), container_type.to_string()));
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let architecture_logits = self.path.last().is_some_and(|(name, _)| name == "alpha");
        if self.error.is_some() || architecture_logits {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let shape = tensor.dims();
        match self.draw(&shape) {
            Ok(values) => {
                let grad = tensor.is_require_grad();
                let redrawn = Tensor::from_data(TensorData::new(values, shape), &tensor.device());
                Param::from_mapped_value(id, redrawn.set_require_grad(grad), mapper)
            }
            Err(error) => {
                self.error = Some(error);
                Param::from_mapped_value(id, tensor, mapper)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn randperm_is_a_permutation() {
        let mut order = TorchRng::new(3).randperm(1000);
        order.sort_unstable();
        assert_eq!(order, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn uniform_stays_in_its_bounds() {
        let mut rng = TorchRng::new(0);
        assert!((0..10_000).map(|_| rng.uniform(-0.25, 0.5)).all(|x| (-0.25..0.5).contains(&x)));
        assert_eq!(rng.draws(), 10_000);
    }
}
