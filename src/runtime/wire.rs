//! How the runtime's messages become bytes for a [`super::transport`] and
//! back: activations with their masks, gradients, updated blocks and block
//! states. Tensors travel as their shape and little-endian `f32` values, so
//! a decoded tensor equals the sent one bit for bit; gradients are matched
//! to the receiver's copy of the block by parameter order (each process
//! draws its own parameter ids), blocks travel as their records.

use burn::module::{ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use pipebd_core::{Activation, StudentModule};
use pipebd_kernels::DistillBackend;

use super::messages::{ActivationMsg, GradientMsg, ModuleMsg};
use crate::error::{Error, Result};
use crate::train::{load_module_bytes, module_bytes, StepLoss, TrainerState};

/// Appends length-prefixed fields to a message.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    /// Appends `value` (8 bytes, little-endian).
    pub fn u64(&mut self, value: u64) -> &mut Self {
        self.0.extend_from_slice(&value.to_le_bytes());
        self
    }
    /// Appends `value`'s length, then its bytes.
    pub fn bytes(&mut self, value: &[u8]) -> &mut Self {
        self.u64(value.len() as u64);
        self.0.extend_from_slice(value);
        self
    }
    /// Appends the count of `values`, then each as little-endian `f32`.
    pub fn f32s(&mut self, values: &[f32]) -> &mut Self {
        self.u64(values.len() as u64);
        self.0.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        self
    }
    /// A tensor's shape and its values as little-endian `f32`s.
    fn tensor<B: Backend, const D: usize>(&mut self, tensor: Tensor<B, D>) -> Result<&mut Self> {
        let dims = tensor.dims();
        let data = tensor.into_data().convert::<f32>();
        self.u64(D as u64);
        for d in dims {
            self.u64(d as u64);
        }
        if cfg!(target_endian = "little") {
            // The values' memory is already the wire format.
            return Ok(self.bytes(data.as_bytes()));
        }
        let values: Vec<f32> = data
            .to_vec()
            .map_err(|e| Error::Transport { message: format!("cannot read a tensor for sending: {e:?}") })?;
        self.u64(4 * values.len() as u64);
        self.0.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        Ok(self)
    }
}

/// Reads the fields a [`Writer`] wrote, in order; every read checks the length.
pub struct Reader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader of `bytes`, a message of kind `what` (named in errors).
    pub fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Self { bytes, what }
    }
    fn short(&self) -> Error {
        Error::Transport {
            message: format!("{} message ended early (corrupt, or another version)", article(self.what)),
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.bytes.len() < n {
            return Err(self.short());
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    /// The next 8-byte little-endian integer.
    pub fn u64(&mut self) -> Result<u64> {
        let raw = self.take(8)?;
        Ok(u64::from_le_bytes(raw.try_into().map_err(|_| self.short())?))
    }
    fn len(&mut self, width: usize) -> Result<usize> {
        let n = self.u64()? as usize;
        if n.checked_mul(width).is_none_or(|total| total > self.bytes.len()) {
            return Err(self.short());
        }
        Ok(n)
    }
    /// The next length-prefixed run of bytes.
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.len(1)?;
        self.take(n)
    }
    /// The next count-prefixed little-endian `f32`s.
    pub fn f32s(&mut self) -> Result<Vec<f32>> {
        let n = self.len(4)?;
        Ok(f32s_from_le(self.take(n * 4)?))
    }
    /// A tensor of rank `D` on `device`.
    fn tensor<B: Backend, const D: usize>(&mut self, device: &B::Device) -> Result<Tensor<B, D>> {
        let rank = self.u64()? as usize;
        if rank != D {
            return Err(Error::Transport {
                message: format!(
                    "{} message holds a rank-{rank} tensor where rank {D} was expected",
                    article(self.what)
                ),
            });
        }
        let shape: Vec<usize> = (0..D).map(|_| self.u64().map(|d| d as usize)).collect::<Result<_>>()?;
        let raw = self.bytes()?;
        let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if Some(raw.len()) != elements.and_then(|n| n.checked_mul(4)) {
            return Err(self.short());
        }
        let data = if cfg!(target_endian = "little") {
            TensorData::from_bytes_vec(raw.to_vec(), shape, DType::F32)
        } else {
            TensorData::new(f32s_from_le(raw), shape)
        };
        Ok(Tensor::from_data(data, device))
    }
    /// Succeeds only when every byte was read (a longer message is refused).
    pub fn finish(&self) -> Result<()> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(Error::Transport {
                message: format!("{} message has {} bytes too many", article(self.what), self.bytes.len()),
            })
        }
    }
}

/// `a what` or `an what`.
fn article(what: &str) -> String {
    match what.starts_with(['a', 'e', 'i', 'o', 'u']) {
        true => format!("an {what}"),
        false => format!("a {what}"),
    }
}

/// Little-endian `f32`s, four bytes each.
fn f32s_from_le(raw: &[u8]) -> Vec<f32> {
    raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// An activation (with its mask) as bytes.
pub fn encode_activation<B: Backend>(writer: &mut Writer, activation: Activation<B>) -> Result<()> {
    match activation {
        Activation::Flat(t) => {
            writer.u64(0).tensor(t)?;
        }
        Activation::Tokens { hidden, mask } => {
            writer.u64(1).tensor(hidden)?.tensor(mask)?;
        }
        Activation::Maps(t) => {
            writer.u64(2).tensor(t)?;
        }
    }
    Ok(())
}

/// The activation [`encode_activation`] wrote, on `device`.
pub fn decode_activation<B: Backend>(reader: &mut Reader<'_>, device: &B::Device) -> Result<Activation<B>> {
    Ok(match reader.u64()? {
        0 => Activation::Flat(reader.tensor(device)?),
        1 => Activation::Tokens { hidden: reader.tensor(device)?, mask: reader.tensor(device)? },
        2 => Activation::Maps(reader.tensor(device)?),
        other => {
            return Err(Error::Transport { message: format!("unknown activation kind {other} in a message") })
        }
    })
}

/// Writes the gradient of every parameter of a module, in the module's
/// parameter order (`None` for a parameter without one).
struct GradientWriter<'a> {
    grads: &'a GradientsParams,
    entries: Vec<Option<Writer>>,
    failure: Option<Error>,
}

impl<B: DistillBackend> ModuleVisitor<B> for GradientWriter<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) else {
            self.entries.push(None);
            return;
        };
        let mut w = Writer::default();
        match w.tensor(grad) {
            Ok(_) => self.entries.push(Some(w)),
            Err(e) => {
                self.failure.get_or_insert(e);
            }
        }
    }
}

/// Registers the received gradients under the receiver's parameters, in
/// the same order (each process draws its own parameter ids).
struct GradientReader<'a, IB: Backend> {
    entries: std::vec::IntoIter<Option<&'a [u8]>>,
    device: &'a IB::Device,
    grads: GradientsParams,
    failure: Option<Error>,
}

impl<B: DistillBackend> ModuleVisitor<B> for GradientReader<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(entry) = self.entries.next() else {
            self.failure.get_or_insert(Error::Transport {
                message: "received gradients for fewer parameters than this copy of the block has".into(),
            });
            return;
        };
        let Some(raw) = entry else { return };
        let mut reader = Reader::new(raw, "gradients");
        match reader.tensor::<B::InnerBackend, D>(self.device) {
            Ok(t) => self.grads.register::<B::InnerBackend, D>(param.id, t),
            Err(e) => {
                self.failure.get_or_insert(e);
            }
        }
    }
}

/// The gradients of `module`'s parameters in `grads` as bytes, in the
/// module's parameter order.
pub fn encode_gradients<B: DistillBackend, S: StudentModule<B>>(
    writer: &mut Writer,
    module: &S,
    grads: &GradientsParams,
) -> Result<()> {
    let mut visitor = GradientWriter { grads, entries: Vec::new(), failure: None };
    module.visit(&mut visitor);
    if let Some(e) = visitor.failure {
        return Err(e);
    }
    writer.u64(visitor.entries.len() as u64);
    for entry in visitor.entries {
        match entry {
            Some(entry) => writer.u64(1).bytes(&entry.0),
            None => writer.u64(0),
        };
    }
    Ok(())
}

/// The gradients [`encode_gradients`] wrote, for the receiver's copy
/// `module` of the same block (matched by parameter order).
pub fn decode_gradients<B: DistillBackend, S: StudentModule<B>>(
    reader: &mut Reader<'_>,
    module: &S,
    device: &B::Device,
) -> Result<GradientsParams> {
    let count = reader.u64()? as usize;
    let mut entries = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        entries.push(match reader.u64()? {
            0 => None,
            _ => Some(reader.bytes()?),
        });
    }
    let mut visitor = GradientReader::<B::InnerBackend> {
        entries: entries.into_iter(),
        device,
        grads: GradientsParams::new(),
        failure: None,
    };
    module.visit(&mut visitor);
    if let Some(e) = visitor.failure {
        return Err(e);
    }
    if visitor.entries.next().is_some() {
        return Err(Error::Transport {
            message: "received gradients for more parameters than this copy of the block has".into(),
        });
    }
    Ok(visitor.grads)
}

/// A block's weights as bytes (as a checkpoint keeps them).
pub fn encode_module<B: DistillBackend, S: StudentModule<B>>(writer: &mut Writer, module: &S) -> Result<()> {
    let bytes = module_bytes(module)
        .map_err(|e| Error::Transport { message: format!("cannot serialise a block for sending: {e}") })?;
    writer.bytes(&bytes);
    Ok(())
}

/// The weights [`encode_module`] wrote, loaded into a copy of `template`
/// (which keeps its autodiff setting) on `device`.
pub fn decode_module<B: DistillBackend, S: StudentModule<B>>(
    reader: &mut Reader<'_>,
    template: &S,
    device: &B::Device,
) -> Result<S> {
    let module = load_module_bytes(template.clone(), reader.bytes()?.to_vec(), device)
        .map_err(|message| Error::Transport { message: format!("a received block: {message}") })?;
    Ok(module.fork(device))
}

/// A block's whole state (weights, optimizer, step, recent losses) as bytes.
pub fn encode_state(writer: &mut Writer, state: &TrainerState) {
    writer.bytes(&state.weights).bytes(&state.optimizer);
    match &state.arch_optimizer {
        Some(arch) => writer.u64(1).bytes(arch),
        None => writer.u64(0),
    };
    writer.u64(state.step as u64).f32s(&state.recent_losses);
}

/// The state [`encode_state`] wrote.
pub fn decode_state(reader: &mut Reader<'_>) -> Result<TrainerState> {
    let weights = reader.bytes()?.to_vec();
    let optimizer = reader.bytes()?.to_vec();
    let arch_optimizer = match reader.u64()? {
        0 => None,
        _ => Some(reader.bytes()?.to_vec()),
    };
    let step = reader.u64()? as usize;
    let recent_losses = reader.f32s()?;
    Ok(TrainerState { weights, optimizer, arch_optimizer, step, recent_losses })
}

/// A boundary activation of one step, for a worker of another rank.
pub(super) fn encode_activation_msg<IB: Backend>(msg: ActivationMsg<IB>) -> Result<Vec<u8>> {
    let mut w = Writer::default();
    w.u64(msg.step as u64).u64(msg.arch as u64);
    encode_activation(&mut w, msg.activation)?;
    Ok(w.0)
}

/// The activation message [`encode_activation_msg`] wrote, on `device`.
pub(super) fn decode_activation_msg<IB: Backend>(
    bytes: Vec<u8>,
    device: &IB::Device,
) -> Result<ActivationMsg<IB>> {
    let mut r = Reader::new(&bytes, "activation");
    let step = r.u64()? as usize;
    let arch = r.u64()? != 0;
    let activation = decode_activation(&mut r, device)?;
    r.finish()?;
    Ok(ActivationMsg { step, arch, activation })
}

/// A follower's gradients of one step; `modules` are its active blocks, in
/// the order of `msg.grads`.
pub(super) fn encode_gradient_msg<B: DistillBackend, S: StudentModule<B>>(
    msg: GradientMsg<B::InnerBackend>,
    modules: &[&S],
) -> Result<Vec<u8>> {
    let mut w = Writer::default();
    w.u64(msg.step as u64).u64(msg.grads.len() as u64);
    for (grads, module) in msg.grads.iter().zip(modules) {
        encode_gradients::<B, S>(&mut w, module, grads)?;
    }
    // Across processes the losses travel as values (read back here).
    let losses: Vec<f32> = msg.weighted_losses.iter().map(StepLoss::value).collect();
    w.f32s(&losses);
    Ok(w.0)
}

/// The gradients [`encode_gradient_msg`] wrote, for the leader's copies
/// `modules` of the same blocks.
pub(super) fn decode_gradient_msg<B: DistillBackend, S: StudentModule<B>>(
    bytes: Vec<u8>,
    modules: &[&S],
    device: &B::Device,
) -> Result<GradientMsg<B::InnerBackend>> {
    let mut r = Reader::new(&bytes, "gradients");
    let step = r.u64()? as usize;
    let count = r.u64()? as usize;
    if count != modules.len() {
        return Err(Error::Transport {
            message: format!(
                "received gradients of {count} blocks at step {step}, expected {}",
                modules.len()
            ),
        });
    }
    let grads = modules.iter().map(|m| decode_gradients::<B, S>(&mut r, m, device)).collect::<Result<_>>()?;
    let weighted_losses = r.f32s()?.into_iter().map(StepLoss::Read).collect();
    r.finish()?;
    Ok(GradientMsg { step, grads, weighted_losses })
}

/// A leader's updated blocks of one step.
pub(super) fn encode_module_msg<B: DistillBackend, S: StudentModule<B>>(
    msg: ModuleMsg<S>,
) -> Result<Vec<u8>> {
    let mut w = Writer::default();
    w.u64(msg.step as u64).u64(msg.modules.len() as u64);
    for module in &msg.modules {
        encode_module::<B, S>(&mut w, module)?;
    }
    Ok(w.0)
}

/// The blocks [`encode_module_msg`] wrote, loaded into copies of the
/// follower's `templates` on `device`.
pub(super) fn decode_module_msg<B: DistillBackend, S: StudentModule<B>>(
    bytes: Vec<u8>,
    templates: &[&S],
    device: &B::Device,
) -> Result<ModuleMsg<S>> {
    let mut r = Reader::new(&bytes, "blocks");
    let step = r.u64()? as usize;
    let count = r.u64()? as usize;
    if count != templates.len() {
        return Err(Error::Transport {
            message: format!("received {count} updated blocks at step {step}, expected {}", templates.len()),
        });
    }
    let modules =
        templates.iter().map(|t| decode_module::<B, S>(&mut r, t, device)).collect::<Result<_>>()?;
    r.finish()?;
    Ok(ModuleMsg { step, modules })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn an_activation_survives_the_wire_bit_for_bit() {
        let device = Default::default();
        let hidden =
            Tensor::<Flex, 3>::random([2, 3, 4], burn::tensor::Distribution::Normal(0.0, 1.0), &device);
        let mask = Tensor::<Flex, 2>::from_data([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], &device);
        let mut w = Writer::default();
        encode_activation(&mut w, Activation::Tokens { hidden: hidden.clone(), mask: mask.clone() }).unwrap();
        let mut r = Reader::new(&w.0, "activation");
        let Activation::Tokens { hidden: h, mask: m } = decode_activation::<Flex>(&mut r, &device).unwrap()
        else {
            panic!("wrong kind decoded");
        };
        r.finish().unwrap();
        assert_eq!(h.into_data(), hidden.into_data());
        assert_eq!(m.into_data(), mask.into_data());
        // A truncated message is an error, not a panic.
        let mut short = Reader::new(&w.0[..w.0.len() - 3], "activation");
        assert!(decode_activation::<Flex>(&mut short, &device).is_err());
        // A shape whose product overflows to the 0 bytes sent (fuzzing's
        // finding) is refused, not built.
        let mut lying = Writer::default();
        lying.u64(1).u64(3).u64(1 << 62).u64(4).u64(4).bytes(&[]);
        let error = decode_activation::<Flex>(&mut Reader::new(&lying.0, "activation"), &device).unwrap_err();
        assert!(error.to_string().contains("an activation message ended early"), "{error}");
    }

    #[test]
    fn a_state_survives_the_wire() {
        let state = TrainerState {
            weights: vec![1, 2, 3],
            optimizer: vec![4],
            arch_optimizer: Some(vec![5, 6]),
            step: 17,
            recent_losses: vec![0.5, 0.25],
        };
        let mut w = Writer::default();
        encode_state(&mut w, &state);
        let mut r = Reader::new(&w.0, "state");
        let back = decode_state(&mut r).unwrap();
        r.finish().unwrap();
        assert_eq!(
            (back.weights, back.optimizer, back.arch_optimizer, back.step, back.recent_losses),
            (state.weights, state.optimizer, state.arch_optimizer, state.step, state.recent_losses)
        );
    }
}
