//! Datasets: MNIST as a [`Dataset`] (the trait is `pipebd-core`'s), the IDX
//! reader and MNIST splits, and seeded batch order. Text corpora are in
//! [`text`].
//!
//! Only the workers of a pipeline's first stage touch a dataset: they turn
//! sample indices into the first block's input on their device.

pub mod text;

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use pipebd_core::{Activation, Dataset, Samples};
use pipebd_kernels::FusedBackend;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::error::{Error, Result};

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

const IMAGES_MAGIC: u32 = 0x0000_0803;
const LABELS_MAGIC: u32 = 0x0000_0801;
const IMAGES_WHAT: &str = "image (idx3, u8)";
const LABELS_WHAT: &str = "label (idx1, u8)";

/// Images read from an IDX file (`u8` pixels, row-major).
#[derive(Debug, Clone)]
pub struct IdxImages {
    /// Number of images.
    pub count: usize,
    /// Rows per image.
    pub rows: usize,
    /// Columns per image.
    pub cols: usize,
    /// `count * rows * cols` pixels.
    pub pixels: Vec<u8>,
}

pub(crate) fn data_error(path: &Path, message: impl Into<String>) -> Error {
    Error::Data { path: path.to_path_buf(), message: message.into() }
}

/// The error for a data file that cannot be opened or read: missing files
/// point to the setup script.
fn open_error(path: &Path, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::NotFound {
        data_error(path, "not found (run scripts/setup-data.sh, or fix `data.dir` in the config)")
    } else {
        data_error(path, format!("cannot read: {e}"))
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| open_error(path, e))
}

fn header(path: &Path, bytes: &[u8], words: usize) -> Result<Vec<u32>> {
    if bytes.len() < 4 * words {
        return Err(data_error(
            path,
            format!("truncated header: {} bytes, expected at least {}", bytes.len(), 4 * words),
        ));
    }
    Ok(bytes[..4 * words].chunks_exact(4).map(|w| u32::from_be_bytes([w[0], w[1], w[2], w[3]])).collect())
}

fn check_magic(path: &Path, found: u32, expected: u32, what: &str) -> Result<()> {
    if found != expected {
        return Err(data_error(
            path,
            format!("wrong magic number {found:#010x}: expected {expected:#010x} for an IDX {what} file"),
        ));
    }
    Ok(())
}

fn check_length(path: &Path, actual: usize, expected: usize) -> Result<()> {
    if actual != expected {
        let kind = if actual < expected { "truncated" } else { "too long" };
        return Err(data_error(path, format!("{kind}: {actual} bytes, the header announces {expected}")));
    }
    Ok(())
}

/// Bytes of a `u8` IDX file whose header holds the magic number and `dims`:
/// the header plus the product of the dimensions. A crafted header whose
/// size does not fit in memory is reported as corrupt, not multiplied blindly.
fn idx_length(path: &Path, dims: &[u32]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d as usize))
        .and_then(|n| n.checked_add(4 * (1 + dims.len())))
        .ok_or_else(|| {
            let message = format!("corrupt header: dimensions {dims:?} announce more bytes than can exist");
            data_error(path, message)
        })
}

/// Checks an IDX file's header against `magic` and the file's `size` in
/// bytes: `head` holds at least its first `4 * (1 + dims)` bytes. Returns
/// the `dims` dimensions.
fn idx_dims(path: &Path, head: &[u8], size: usize, magic: u32, dims: usize, what: &str) -> Result<Vec<u32>> {
    check_magic(path, header(path, head, 1)?[0], magic, what)?;
    let h = header(path, head, 1 + dims)?;
    check_length(path, size, idx_length(path, &h[1..])?)?;
    Ok(h[1..].to_vec())
}

/// Reads an uncompressed IDX3 image file (`*-images-idx3-ubyte`).
pub fn read_idx_images(path: &Path) -> Result<IdxImages> {
    let bytes = read_file(path)?;
    let d = idx_dims(path, &bytes, bytes.len(), IMAGES_MAGIC, 3, IMAGES_WHAT)?;
    let (count, rows, cols) = (d[0] as usize, d[1] as usize, d[2] as usize);
    Ok(IdxImages { count, rows, cols, pixels: bytes[16..].to_vec() })
}

/// Reads an uncompressed IDX1 label file (`*-labels-idx1-ubyte`).
///
/// Labels must be below `classes`.
pub fn read_idx_labels(path: &Path, classes: u8) -> Result<Vec<u8>> {
    let bytes = read_file(path)?;
    idx_dims(path, &bytes, bytes.len(), LABELS_MAGIC, 1, LABELS_WHAT)?;
    let labels = bytes[8..].to_vec();
    if let Some((i, bad)) = labels.iter().enumerate().find(|(_, &l)| l >= classes) {
        return Err(data_error(path, format!("label {bad} at index {i} is not below {classes}")));
    }
    Ok(labels)
}

/// Reads only the header of an IDX file: checks its magic number and that
/// the file is as long as the header announces. Returns the item count.
fn check_idx_file(path: &Path, magic: u32, dims: usize, what: &str) -> Result<usize> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| open_error(path, e))?;
    let size = file.metadata().map_err(|e| open_error(path, e))?.len();
    let mut head = Vec::with_capacity(4 * (1 + dims));
    file.take(4 * (1 + dims) as u64).read_to_end(&mut head).map_err(|e| open_error(path, e))?;
    let size = usize::try_from(size).unwrap_or(usize::MAX);
    Ok(idx_dims(path, &head, size, magic, dims, what)?[0] as usize)
}

/// Mean of MNIST's training pixels in [0, 1]: what [`ImageDataset::load_mnist`]
/// subtracts (as torchvision's MNIST examples, and the pretrained teacher, do).
pub const MNIST_MEAN: f32 = 0.1307;
/// Standard deviation of MNIST's training pixels in [0, 1]: what
/// [`ImageDataset::load_mnist`] divides by.
pub const MNIST_STD: f32 = 0.3081;

/// Checks the four MNIST files in `dir` without reading their pixels: each
/// is there, has the right magic number and is as long as its header says,
/// and each split has as many labels as images. What `pipebd check` runs.
/// Returns the number of training images.
pub fn check_mnist_files(dir: &Path) -> Result<usize> {
    if !dir.is_dir() {
        return Err(data_error(
            dir,
            "folder not found (run scripts/setup-data.sh, or fix `data.dir` in the config)",
        ));
    }
    let mut train = 0;
    for split in [Split::Train, Split::Test] {
        let (images, labels) = split.files(dir);
        let image_count = check_idx_file(&images, IMAGES_MAGIC, 3, IMAGES_WHAT)?;
        let label_count = check_idx_file(&labels, LABELS_MAGIC, 1, LABELS_WHAT)?;
        if image_count != label_count {
            return Err(data_error(
                &labels,
                format!("{label_count} labels for {image_count} images in {}", images.display()),
            ));
        }
        if split == Split::Train {
            train = image_count;
        }
    }
    Ok(train)
}

/// Which half of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// The training set.
    Train,
    /// The held-out test set.
    Test,
}

impl Split {
    /// The split's MNIST-format image and label files in `dir`
    /// (`train-*-ubyte` or `t10k-*-ubyte`).
    pub fn files(self, dir: &Path) -> (PathBuf, PathBuf) {
        let prefix = match self {
            Split::Train => "train",
            Split::Test => "t10k",
        };
        (dir.join(format!("{prefix}-images-idx3-ubyte")), dir.join(format!("{prefix}-labels-idx1-ubyte")))
    }
}

/// An image-classification split held in memory.
#[derive(Debug, Clone)]
pub struct ImageDataset {
    /// The images.
    pub images: IdxImages,
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
    /// Loads an MNIST-format split from `dir` (files `train-*-ubyte` or
    /// `t10k-*-ubyte`), keeping at most `limit` samples.
    pub fn load_mnist(dir: &Path, split: Split, limit: Option<usize>) -> Result<Self> {
        let (images_path, labels_path) = split.files(dir);
        let mut images = read_idx_images(&images_path)?;
        let mut labels = read_idx_labels(&labels_path, 10)?;
        if images.count != labels.len() {
            return Err(data_error(
                &labels_path,
                format!("{} labels for {} images in {}", labels.len(), images.count, images_path.display()),
            ));
        }
        if let Some(limit) = limit {
            let n = limit.min(images.count);
            images.pixels.truncate(n * images.rows * images.cols);
            images.count = n;
            labels.truncate(n);
        }
        Ok(Self { images, labels, mean: MNIST_MEAN, std: MNIST_STD, on_device: DeviceCopies::default() })
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
