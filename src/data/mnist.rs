//! MNIST-format data (MNIST, Fashion-MNIST): the IDX reader, the two
//! splits' files, and the pixel statistics the pretrained MNIST teacher was
//! trained with. In the engine, so that a library user reads MNIST without
//! the built-in zoo (which uses it for its MNIST CNN teacher).

use std::path::{Path, PathBuf};

use crate::data::{data_error, GrayImages, ImageDataset};
use crate::error::{Error, Result};

const IMAGES_MAGIC: u32 = 0x0000_0803;
const LABELS_MAGIC: u32 = 0x0000_0801;
const IMAGES_WHAT: &str = "image (idx3, u8)";
const LABELS_WHAT: &str = "label (idx1, u8)";

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
pub fn read_idx_images(path: &Path) -> Result<GrayImages> {
    let bytes = read_file(path)?;
    let d = idx_dims(path, &bytes, bytes.len(), IMAGES_MAGIC, 3, IMAGES_WHAT)?;
    let (count, rows, cols) = (d[0] as usize, d[1] as usize, d[2] as usize);
    Ok(GrayImages { count, rows, cols, pixels: bytes[16..].to_vec() })
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

/// Mean of MNIST's training pixels in [0, 1]: what [`load`]
/// subtracts (as torchvision's MNIST examples, and the pretrained teacher, do).
pub const MNIST_MEAN: f32 = 0.1307;
/// Standard deviation of MNIST's training pixels in [0, 1]: what
/// [`load`] divides by.
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

/// Loads an MNIST-format split from `dir` (files `train-*-ubyte` or
/// `t10k-*-ubyte`), keeping at most `limit` samples, normalised with
/// [`MNIST_MEAN`] and [`MNIST_STD`].
pub fn load(dir: &Path, split: Split, limit: Option<usize>) -> Result<ImageDataset> {
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
    Ok(ImageDataset::new(images, labels, MNIST_MEAN, MNIST_STD))
}
