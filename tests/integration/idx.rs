//! The IDX reader: good files, truncated files, wrong magic numbers.

use std::path::Path;

use pipe_bd::Error;
use pipebd_zoo::mnist::{read_idx_images, read_idx_labels, Split};

fn idx_images(count: u32, rows: u32, cols: u32, pixels: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for word in [0x0803u32, count, rows, cols] {
        bytes.extend(word.to_be_bytes());
    }
    bytes.extend(pixels);
    bytes
}

fn idx_labels(labels: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for word in [0x0801u32, labels.len() as u32] {
        bytes.extend(word.to_be_bytes());
    }
    bytes.extend(labels);
    bytes
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn data_message(result: Result<impl std::fmt::Debug, Error>, path: &Path) -> String {
    match result {
        Err(e @ Error::Data { .. }) => {
            let text = e.to_string();
            assert!(text.contains(&path.display().to_string()), "error does not name the file: {text}");
            text
        }
        other => panic!("expected a data error, got {other:?}"),
    }
}

#[test]
fn reads_a_good_image_file_big_endian() {
    let dir = tempfile::tempdir().unwrap();
    let pixels: Vec<u8> = (0..2 * 3 * 2).map(|i| i as u8 * 10).collect();
    let path = write(dir.path(), "good-images", &idx_images(2, 3, 2, &pixels));
    let images = read_idx_images(&path).unwrap();
    assert_eq!((images.count, images.rows, images.cols), (2, 3, 2));
    assert_eq!(images.pixels, pixels);
}

#[test]
fn reads_a_good_label_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "good-labels", &idx_labels(&[3, 1, 4, 1, 5, 9]));
    assert_eq!(read_idx_labels(&path, 10).unwrap(), vec![3, 1, 4, 1, 5, 9]);
}

#[test]
fn rejects_a_truncated_image_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = idx_images(2, 3, 2, &[7; 12]);
    bytes.truncate(bytes.len() - 1);
    let path = write(dir.path(), "short-images", &bytes);
    let text = data_message(read_idx_images(&path), &path);
    assert!(text.contains("truncated"), "{text}");
}

#[test]
fn rejects_a_truncated_header() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "stub", &[0, 0, 8, 3, 0, 0]);
    let text = data_message(read_idx_images(&path), &path);
    assert!(text.contains("header"), "{text}");
}

#[test]
fn rejects_a_label_file_given_as_images() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "labels-not-images", &idx_labels(&[1, 2, 3]));
    let text = data_message(read_idx_images(&path), &path);
    assert!(text.contains("magic"), "{text}");
}

#[test]
fn rejects_an_image_file_given_as_labels() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "images-not-labels", &idx_images(1, 2, 2, &[0; 4]));
    let text = data_message(read_idx_labels(&path, 10), &path);
    assert!(text.contains("magic"), "{text}");
}

#[test]
fn rejects_out_of_range_labels() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "bad-labels", &idx_labels(&[1, 12, 3]));
    let text = data_message(read_idx_labels(&path, 10), &path);
    assert!(text.contains("12"), "{text}");
}

#[test]
fn rejects_mismatched_image_and_label_counts() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "t10k-images-idx3-ubyte", &idx_images(3, 2, 2, &[0; 12]));
    let labels = write(dir.path(), "t10k-labels-idx1-ubyte", &idx_labels(&[1, 2]));
    let text = data_message(pipebd_zoo::mnist::load(dir.path(), Split::Test, None), &labels);
    assert!(text.contains("2 labels for 3 images"), "{text}");
}

#[test]
fn missing_files_point_to_the_setup_script() {
    let dir = tempfile::tempdir().unwrap();
    let err = pipebd_zoo::mnist::load(dir.path(), Split::Train, None).unwrap_err();
    assert!(err.to_string().contains("setup-data.sh"), "{err}");
}

#[test]
fn real_mnist_test_split_has_ten_thousand_labelled_images() {
    let data = pipebd_zoo::mnist::load(&common::mnist_dir(), Split::Test, None).unwrap();
    assert_eq!(data.len(), 10_000);
    assert_eq!(data.sample_shape(), vec![1, 28, 28]);
    let mut counts = [0usize; 10];
    for &l in &data.labels {
        counts[l as usize] += 1;
    }
    assert!(counts.iter().all(|&c| c > 800), "class counts {counts:?}");
}

use crate::common;
