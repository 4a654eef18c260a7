//! `wide!`: CPU loops compiled for AVX2 where the CPU has it.

/// Defines a function whose body is compiled twice: for the baseline
/// target and, on x86-64, with AVX2 (taken at run time where the CPU has
/// it), so that its loops vectorise eight lanes wide. Rust contracts no
/// multiply-add on its own, so both give the same values.
macro_rules! wide {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: this CPU has AVX2 (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
