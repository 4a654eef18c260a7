//! The launch geometry of the convolution and pooling kernels (tile sizes,
//! cube counts, a convolution's sizes and whether the kernels take it), the
//! sizes every convolution kernel takes as one argument ([`ConvShape`]),
//! and the index and tile arithmetic their kernels share: where an output
//! column reads its input, the pre-activation gradient at an output
//! position, and the product of two staged tiles.

use burn::tensor::ops::ConvOptions;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;

use super::common::{epilogue_code, outer_product_add};
use crate::Epilogue;

/// Columns of the output tile of a cube (units along x: 16, 4 columns each).
pub(super) const TILE_N: usize = 64;

/// Reduction step staged in shared memory.
pub(super) const TILE_K: usize = 16;

/// Most cubes along one grid axis.
const MAX_GRID: usize = 65_535;

/// Units per cube of the direct kernels.
pub(super) const UNITS: u32 = 256;

/// The activation's derivative at the saved output `s` (epilogue codes as
/// [`super::common::epilogue_code`]; gelu never reaches these kernels).
#[cube]
fn keeps_gradient<F: Float>(s: F, #[comptime] epilogue: u32) -> F {
    let mut keep = F::new(1.0);
    if epilogue == 1 {
        if s <= F::new(0.0) {
            keep = F::new(0.0);
        }
    }
    if epilogue == 2 {
        if s <= F::new(0.0) || s >= F::new(6.0) {
            keep = F::new(0.0);
        }
    }
    keep
}

/// The pre-activation gradient at full-resolution output `(oy, ox)` of
/// `plane` (sample `b`, channel `c`: `b * c_out + c`) of a convolution of
/// `shape`. Unpooled: `grad * act'(saved)` there. Pooled (`grad`, `saved`
/// and `indices` at half resolution `ph x pw`): that of the window, where
/// the window's maximum sat, else zero.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn pre_gradient<F: Float, I: Int>(
    grad: &Array<F>,
    saved: &Array<F>,
    indices: &Array<I>,
    shape: &ConvShape,
    plane: usize,
    oy: usize,
    ox: usize,
    #[comptime] pooled: bool,
) -> F {
    let mut g = F::new(0.0);
    if pooled {
        let (ph, pw) = (shape.oh / 2, shape.ow / 2);
        if oy < 2 * ph && ox < 2 * pw {
            let at = (plane * ph + oy / 2) * pw + ox / 2;
            if u32::cast_from(indices[at]) as usize == oy * shape.ow + ox {
                g = grad[at] * keeps_gradient::<F>(saved[at], shape.epilogue);
            }
        }
    } else {
        let at = (plane * shape.oh + oy) * shape.ow + ox;
        g = grad[at] * keeps_gradient::<F>(saved[at], shape.epilogue);
    }
    g
}

/// The output tile this cube owns along the columns (grids longer than
/// [`MAX_GRID`] fold into the z axis).
#[cube]
pub(super) fn column_tile() -> usize {
    CUBE_POS_Z as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize
}

/// The input value under filter tap `(ky, kx)` of output position `(oy,
/// ox)` of sample `b`, channel `c` of a convolution of `shape` (zero in the
/// padding).
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn input_at<F: Float>(
    x: &Array<F>,
    shape: &ConvShape,
    b: usize,
    c: usize,
    oy: usize,
    ox: usize,
    ky: usize,
    kx: usize,
) -> F {
    let yy = oy * shape.sy + ky;
    let xx = ox * shape.sx + kx;
    let mut v = F::new(0.0);
    if inside_input(shape, yy, xx) {
        v = x[((b * shape.c_in + c) * shape.h + yy - shape.pad_y) * shape.wd + xx - shape.pad_x];
    }
    v
}

/// Whether `(yy, xx)` of the padded input lies inside the input itself
/// (not in its padding).
#[cube]
pub(super) fn inside_input(shape: &ConvShape, yy: usize, xx: usize) -> bool {
    yy >= shape.pad_y && yy < shape.h + shape.pad_y && xx >= shape.pad_x && xx < shape.wd + shape.pad_x
}

/// Zeroes the first `len` values of `values` (a register tile).
#[cube]
pub(super) fn clear<F: Float>(values: &mut Array<F>, #[comptime] len: usize) {
    #[unroll]
    for i in 0..len {
        values[i] = F::new(0.0);
    }
}

/// Accumulates the staged tiles' product into this unit's 4x4 register tile
/// `acc`: rows `uy + i dy` of `a_tile` (`tile_m x 16`) times columns of
/// `b_tile` (`16 x 64`): `ux + 16 j`, or with `adjacent` the four
/// neighbouring columns `4 ux + j` (a pooling window's pixels).
#[cube]
pub(super) fn multiply_tiles<F: Float>(
    acc: &mut Array<F>,
    a_tile: &SharedMemory<F>,
    b_tile: &SharedMemory<F>,
    ux: usize,
    uy: usize,
    dy: usize,
    #[comptime] adjacent: bool,
) {
    #[unroll]
    for kk in 0..16usize {
        let a0 = a_tile[uy * 16 + kk];
        let a1 = a_tile[(uy + dy) * 16 + kk];
        let a2 = a_tile[(uy + 2 * dy) * 16 + kk];
        let a3 = a_tile[(uy + 3 * dy) * 16 + kk];
        let mut b0 = b_tile[kk * 64 + ux];
        let mut b1 = b_tile[kk * 64 + ux + 16];
        let mut b2 = b_tile[kk * 64 + ux + 32];
        let mut b3 = b_tile[kk * 64 + ux + 48];
        if adjacent {
            b0 = b_tile[kk * 64 + 4 * ux];
            b1 = b_tile[kk * 64 + 4 * ux + 1];
            b2 = b_tile[kk * 64 + 4 * ux + 2];
            b3 = b_tile[kk * 64 + 4 * ux + 3];
        }
        outer_product_add::<F>(acc, a0, a1, a2, a3, b0, b1, b2, b3);
    }
}

/// A convolution's sizes as its kernels read them, in one kernel argument
/// ([`Geometry::shape`] builds it): the batch, the channels and the input
/// (`h x wd`; `w` names the weights in the kernels) and output planes at
/// run time; the filter (`kh x kw`), the stride, the padding and the
/// activation that follows (`epilogue`, as [`super::common::epilogue_code`])
/// fixed at compile time, so that the loops over the filter taps unroll.
#[derive(CubeLaunch, CubeType, Clone)]
pub(super) struct ConvShape {
    pub batch: usize,
    pub c_in: usize,
    pub h: usize,
    pub wd: usize,
    pub c_out: usize,
    pub oh: usize,
    pub ow: usize,
    #[cube(comptime)]
    pub kh: usize,
    #[cube(comptime)]
    pub kw: usize,
    #[cube(comptime)]
    pub sy: usize,
    #[cube(comptime)]
    pub sx: usize,
    #[cube(comptime)]
    pub pad_y: usize,
    #[cube(comptime)]
    pub pad_x: usize,
    #[cube(comptime)]
    pub epilogue: u32,
}

/// A convolution's sizes, when our kernels take it: no dilation, and
/// either no groups (dense) or one input channel per filter (depthwise).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub(super) batch: usize,
    pub(super) c_in: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) c_out: usize,
    pub(super) kernel: (usize, usize),
    pub(super) stride: (usize, usize),
    pub(super) padding: (usize, usize),
    pub(super) oh: usize,
    pub(super) ow: usize,
    /// One input channel per filter, `c_out` a multiple of `c_in`.
    pub(super) depthwise: bool,
}

impl Geometry {
    pub(crate) fn of<R: CubeRuntime>(
        x: &CubeTensor<R>,
        weight: &CubeTensor<R>,
        options: &ConvOptions<2>,
    ) -> Option<Self> {
        let [batch, c_in, h, w] = x.meta.shape().dims::<4>();
        let [c_out, per_group, kh, kw] = weight.meta.shape().dims::<4>();
        if options.dilation != [1, 1] || batch == 0 || c_out == 0 {
            return None;
        }
        let depthwise = match options.groups {
            1 if per_group == c_in => false,
            g if g == c_in && per_group == 1 && c_out % c_in == 0 && g > 1 => true,
            _ => return None,
        };
        let [sy, sx] = options.stride;
        let [py, px] = options.padding;
        if h + 2 * py < kh || w + 2 * px < kw || sy == 0 || sx == 0 {
            return None;
        }
        let (oh, ow) = ((h + 2 * py - kh) / sy + 1, (w + 2 * px - kw) / sx + 1);
        Some(Self {
            batch,
            c_in,
            h,
            w,
            c_out,
            kernel: (kh, kw),
            stride: (sy, sx),
            padding: (py, px),
            oh,
            ow,
            depthwise,
        })
    }

    pub(super) fn taps(&self) -> usize {
        self.kernel.0 * self.kernel.1
    }

    /// The kernels' [`ConvShape`] argument for this convolution, followed
    /// by `epilogue`.
    pub(super) fn shape<R: Runtime>(&self, epilogue: Epilogue) -> ConvShapeLaunch<R> {
        ConvShapeLaunch::<R>::new(
            self.batch,
            self.c_in,
            self.h,
            self.w,
            self.c_out,
            self.oh,
            self.ow,
            self.kernel.0,
            self.kernel.1,
            self.stride.0,
            self.stride.1,
            self.padding.0,
            self.padding.1,
            epilogue_code(epilogue),
        )
    }
}

/// Rows of a cube's output tile for a matrix of `rows` rows.
pub(super) fn tile_rows(rows: usize) -> usize {
    match rows {
        0..=16 => 16,
        17..=32 => 32,
        _ => 64,
    }
}

/// A grid covering `columns` columns in tiles of [`TILE_N`] (folded into z
/// past [`MAX_GRID`]) and `rows` rows in tiles of `tile_m`.
pub(super) fn matrix_grid(columns: usize, rows: usize, tile_m: usize) -> CubeCount {
    let tiles = columns.div_ceil(TILE_N).max(1);
    let x = tiles.min(MAX_GRID);
    CubeCount::Static(x as u32, rows.div_ceil(tile_m) as u32, tiles.div_ceil(x) as u32)
}

pub(super) fn elementwise_grid(elements: usize) -> CubeCount {
    let cubes = elements.div_ceil(UNITS as usize).max(1);
    assert!(cubes <= MAX_GRID * MAX_GRID, "{elements} elements: too many for one launch");
    let x = cubes.min(MAX_GRID);
    CubeCount::Static(x as u32, cubes.div_ceil(x) as u32, 1)
}

/// The cube of [`UNITS`] units that goes with [`elementwise_grid`].
pub(super) fn units() -> CubeDim {
    CubeDim::new_1d(UNITS)
}

/// Whether our kernels take this convolution (with `epilogue`, followed by
/// the 2x2 max-pool when `pooled`): no dilation, dense or depthwise (not
/// pooled), and an activation whose derivative its output tells.
pub(crate) fn takes<R: CubeRuntime>(
    x: &CubeTensor<R>,
    weight: &CubeTensor<R>,
    options: &ConvOptions<2>,
    epilogue: Epilogue,
    pooled: bool,
) -> bool {
    match Geometry::of(x, weight, options) {
        Some(g) => epilogue != Epilogue::Gelu && !(pooled && g.depthwise),
        None => false,
    }
}
