//! Datasets: images in memory as a [`Dataset`] (the trait is
//! `pipebd-core`'s), seeded batch order and held-out splits. One small
//! format reader lives here so that a library user
//! needs no zoo for it: [`mnist`] (IDX files: MNIST, Fashion-MNIST); other
//! data sets' files are a zoo's business.
//!
//! Only the workers of a pipeline's first stage touch a dataset: they turn
//! sample indices into the first block's input on their device.

pub mod mnist;

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use pipebd_core::{Activation, Dataset, Samples};
use pipebd_kernels::FusedBackend;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::error::Error;

impl Samples for ImageDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }
}

impl<B: FusedBackend> Dataset<B> for ImageDataset {
    /// The normalised images; on an asynchronous device
    /// ([`FusedBackend::ASYNC_DEVICE`]) gathered from a copy of the whole
    /// set kept there (uploaded at the first batch), by an index tensor.
    fn batch(&self, indices: &[usize], device: &B::Device) -> pipebd_core::Result<Activation<B>> {
        if let Some(i) = indices.iter().find(|&&i| i >= self.len()) {
            return Err(pipebd_core::Error::Data {
                message: format!("image {i} requested, but there are {}", self.len()),
            });
        }
        if !B::ASYNC_DEVICE {
            return Ok(Activation::Maps(self.images(indices, device)));
        }
        let all = self.on_device.get_or_insert::<B>(device, || {
            let every: Vec<usize> = (0..self.len()).collect();
            self.images(&every, device)
        });
        let picks: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
        let picks = Tensor::<B, 1, Int>::from_data(TensorData::new(picks, [indices.len()]), device);
        Ok(Activation::Maps(all.select(0, picks)))
    }
}

/// Copies of a dataset's normalised images kept on devices, one per device,
/// made at the first batch there (cloning a dataset starts with none).
#[derive(Default)]
pub struct DeviceCopies(std::sync::Mutex<Vec<Box<dyn std::any::Any + Send>>>);

impl DeviceCopies {
    /// The copy on `device`, made by `make` if there is none yet.
    fn get_or_insert<B: Backend>(
        &self,
        device: &B::Device,
        make: impl FnOnce() -> Tensor<B, 4>,
    ) -> Tensor<B, 4> {
        let mut copies = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let found = copies
            .iter()
            .filter_map(|c| c.downcast_ref::<(B::Device, Tensor<B, 4>)>())
            .find(|(d, _)| d == device)
            .map(|(_, t)| t.clone());
        found.unwrap_or_else(|| {
            let tensor = make();
            copies.push(Box::new((device.clone(), tensor.clone())));
            tensor
        })
    }
}

impl Clone for DeviceCopies {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for DeviceCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let copies = self.0.lock().map(|c| c.len()).unwrap_or(0);
        write!(f, "DeviceCopies({copies})")
    }
}

/// Grayscale images in memory (`u8` pixels, row-major), as an IDX file
/// holds them.
#[derive(Debug, Clone)]
pub struct GrayImages {
    /// Number of images.
    pub count: usize,
    /// Rows per image.
    pub rows: usize,
    /// Columns per image.
    pub cols: usize,
    /// `count * rows * cols` pixels.
    pub pixels: Vec<u8>,
}

/// The error for a data file `path` that is not what it should be.
pub fn data_error(path: &Path, message: impl Into<String>) -> Error {
    Error::Data { path: path.to_path_buf(), message: message.into() }
}

/// An image-classification split held in memory.
#[derive(Debug, Clone)]
pub struct ImageDataset {
    /// The images.
    pub images: GrayImages,
    /// One label per image.
    pub labels: Vec<u8>,
    /// Pixel mean after scaling to [0, 1].
    pub mean: f32,
    /// Pixel standard deviation after scaling to [0, 1].
    pub std: f32,
    /// The normalised images on asynchronous devices (see [`Dataset::batch`]).
    pub on_device: DeviceCopies,
}

impl ImageDataset {
    /// A dataset of `images` with one label each, normalised as
    /// `(pixel / 255 - mean) / std`.
    pub fn new(images: GrayImages, labels: Vec<u8>, mean: f32, std: f32) -> Self {
        Self { images, labels, mean, std, on_device: DeviceCopies::default() }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when there are no samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Per-sample shape `[1, rows, cols]`.
    pub fn sample_shape(&self) -> Vec<usize> {
        vec![1, self.images.rows, self.images.cols]
    }

    /// The normalised images at `indices` as a `[n, 1, rows, cols]` tensor.
    pub fn images<B: Backend>(&self, indices: &[usize], device: &B::Device) -> Tensor<B, 4> {
        let pixels_per_image = self.images.rows * self.images.cols;
        let scale = 1.0 / (255.0 * self.std);
        let shift = self.mean / self.std;
        let mut values = Vec::with_capacity(indices.len() * pixels_per_image);
        for &i in indices {
            let image = &self.images.pixels[i * pixels_per_image..(i + 1) * pixels_per_image];
            values.extend(image.iter().map(|&p| p as f32 * scale - shift));
        }
        let data = TensorData::new(values, [indices.len(), 1, self.images.rows, self.images.cols]);
        Tensor::from_data(data, device)
    }

    /// The labels at `indices`.
    pub fn labels_at(&self, indices: &[usize]) -> Vec<u8> {
        indices.iter().map(|&i| self.labels[i]).collect()
    }
}

/// Where a run's epoch orders come from; each depends only on the run's
/// seed and the epoch, so every schedule (and a resumed run) sees the same
/// batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataOrder {
    /// pipe-bd's own seeded shuffle ([`epoch_order`]).
    Seeded {
        /// The run's seed.
        seed: u64,
    },
    /// PyTorch's: epoch `e` is the `e+1`-th `torch.randperm(len)` after
    /// `torch.manual_seed(seed)` and `draws_before` draws (the students'
    /// initial weights; see [`crate::rng`]).
    Torch {
        /// The run's seed.
        seed: u64,
        /// Draws taken from the generator before the first epoch's order.
        draws_before: u64,
    },
}

impl DataOrder {
    /// The order for `generator` in a run with `seed` whose students have
    /// `student_params` parameters in all (each drawn once by PyTorch's
    /// generator before the first epoch's order).
    pub fn new(generator: crate::rng::Generator, seed: u64, student_params: usize) -> Self {
        match generator {
            crate::rng::Generator::Native => DataOrder::Seeded { seed },
            crate::rng::Generator::Torch => DataOrder::Torch { seed, draws_before: student_params as u64 },
        }
    }

    /// The order in which `epoch` visits `len` samples.
    pub fn epoch(&self, len: usize, epoch: usize) -> Vec<usize> {
        match *self {
            DataOrder::Seeded { seed } => epoch_order(len, seed, epoch),
            DataOrder::Torch { seed, draws_before } => {
                let mut rng = crate::rng::TorchRng::new(seed);
                rng.skip(draws_before + epoch as u64 * len.saturating_sub(1) as u64);
                rng.randperm(len)
            }
        }
    }
}

/// The order in which an epoch visits the samples: a seeded shuffle that
/// depends only on `(seed, epoch)`, so every schedule sees the same batches.
pub fn epoch_order(len: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    let mut rng = StdRng::seed_from_u64(seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    order.shuffle(&mut rng);
    order
}

/// A contiguous range of another dataset's samples (a search run trains on
/// the first ones and scores its candidates on the rest).
pub struct DatasetSlice<'a, B: burn::tensor::backend::Backend> {
    inner: &'a dyn Dataset<B>,
    start: usize,
    len: usize,
}

impl<'a, B: burn::tensor::backend::Backend> DatasetSlice<'a, B> {
    /// Samples `start..start + len` of `inner` (clamped to its length).
    pub fn new(inner: &'a dyn Dataset<B>, start: usize, len: usize) -> Self {
        let start = start.min(inner.len());
        Self { inner, start, len: len.min(inner.len() - start) }
    }
}

/// `data` split for a search: the first samples to train on and the last
/// `held_out` fraction (at least one sample, and at least one left to train
/// on) held out; `None` holds nothing out.
pub fn held_out_split<'a, B: burn::tensor::backend::Backend>(
    data: &'a dyn Dataset<B>,
    held_out: Option<f64>,
) -> (DatasetSlice<'a, B>, Option<DatasetSlice<'a, B>>) {
    let n = data.len();
    match held_out {
        Some(fraction) => {
            let held = ((n as f64 * fraction).round() as usize).clamp(1, n.saturating_sub(1));
            (DatasetSlice::new(data, 0, n - held), Some(DatasetSlice::new(data, n - held, held)))
        }
        None => (DatasetSlice::new(data, 0, n), None),
    }
}

impl<B: burn::tensor::backend::Backend> Samples for DatasetSlice<'_, B> {
    fn len(&self) -> usize {
        self.len
    }
}

impl<B: burn::tensor::backend::Backend> Dataset<B> for DatasetSlice<'_, B> {
    fn batch(&self, indices: &[usize], device: &B::Device) -> pipebd_core::Result<Activation<B>> {
        if let Some(&outside) = indices.iter().find(|&&i| i >= self.len) {
            return Err(pipebd_core::Error::Data {
                message: format!("sample {outside} requested of a slice of {} samples", self.len),
            });
        }
        let shifted: Vec<usize> = indices.iter().map(|i| i + self.start).collect();
        self.inner.batch(&shifted, device)
    }
}
