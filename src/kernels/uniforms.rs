//! The kernels' uniform parameter blocks checked against their WGSL: every `#[repr(C)]` struct a host
//! wrapper writes to binding 0 (or into a storage table) is a hand copy of a WGSL struct, so each
//! kernel module lists its structs here ([`UniformLayout`], built by [`uniform_layout!`]) and the test
//! compares each with naga's layout of the WGSL struct in the source that reads it: the size, every
//! member's offset, size and scalar type, and the flag constants both sides declare. A field added,
//! moved or retyped on one side fails here instead of reading garbage on a GPU.

use naga::proc::Layouter;

/// The scalar type of a field's elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scalar {
    U32,
    I32,
    F32,
}

/// A Rust type a uniform field may have: its elements' scalar type.
pub(crate) trait UniformField {
    const SCALAR: Scalar;
}

impl UniformField for u32 {
    const SCALAR: Scalar = Scalar::U32;
}
impl UniformField for i32 {
    const SCALAR: Scalar = Scalar::I32;
}
impl UniformField for f32 {
    const SCALAR: Scalar = Scalar::F32;
}
impl<T: UniformField, const N: usize> UniformField for [T; N] {
    const SCALAR: Scalar = T::SCALAR;
}

/// The size and scalar type of the field `of` reads (the macro's way to name a field's type).
pub(crate) fn field<S, T: UniformField>(_of: fn(&S) -> &T) -> (usize, Option<Scalar>) {
    (std::mem::size_of::<T>(), Some(T::SCALAR))
}

/// The size of the nested struct `of` reads.
pub(crate) fn nested<S, T>(_of: fn(&S) -> &T) -> (usize, Option<Scalar>) {
    (std::mem::size_of::<T>(), None)
}

/// One field of a Rust parameter struct.
#[derive(Clone, Debug)]
pub(crate) struct Field {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
    /// `None` for a nested struct (checked as a struct of its own).
    pub scalar: Option<Scalar>,
}

/// A Rust parameter struct and the WGSL struct it is a copy of.
#[derive(Clone, Debug)]
pub(crate) struct UniformLayout {
    /// The name of a source in [`crate::kernels::shaders::all`] that declares the WGSL struct.
    pub source: &'static str,
    /// The WGSL struct's name.
    pub wgsl: &'static str,
    /// The Rust type's name.
    pub rust: &'static str,
    pub size: usize,
    pub fields: Vec<Field>,
    /// Constants the host writes into the struct (flag bits, view slots), by their WGSL name.
    pub constants: Vec<(&'static str, u32)>,
    /// The WGSL struct is a leading part of the Rust one: a kernel that reads fewer fields of a
    /// block another kernel reads whole ([`UniformLayout::read_as_prefix`]).
    pub prefix: bool,
}

impl UniformLayout {
    /// This layout with the WGSL struct read as a leading part of the Rust one.
    pub fn read_as_prefix(mut self) -> Self {
        self.prefix = true;
        self
    }

    /// This layout, and the same for each of `sources` (kernels that bind the same Rust struct to
    /// a WGSL struct of the same name).
    pub fn also_read_by(self, sources: &[&'static str]) -> Vec<Self> {
        let mut layouts = vec![self.clone()];
        layouts.extend(sources.iter().map(|&source| Self {
            source,
            ..self.clone()
        }));
        layouts
    }
}

/// The layout of Rust struct `$ty`, read by WGSL struct `$wgsl` of source `$source`: every field
/// listed in order (nested structs after `nested`), then the constants to compare by name.
macro_rules! uniform_layout {
    ($source:expr, $wgsl:expr, $ty:ty { $($field:ident),* $(,)? }
     $(nested { $($nested:ident),* $(,)? })?
     $(constants { $($constant:ident),* $(,)? })?) => {{
        use $crate::kernels::uniforms::{field, Field, UniformLayout};
        #[allow(unused_mut)]
        let mut fields = vec![$({
            let (size, scalar) = field::<$ty, _>(|p| &p.$field);
            Field { name: stringify!($field), offset: std::mem::offset_of!($ty, $field), size, scalar }
        }),*];
        $($(fields.push({
            let (size, scalar) = $crate::kernels::uniforms::nested::<$ty, _>(|p| &p.$nested);
            Field { name: stringify!($nested), offset: std::mem::offset_of!($ty, $nested), size, scalar }
        });)*)?
        fields.sort_by_key(|f| f.offset);
        UniformLayout {
            source: $source,
            wgsl: $wgsl,
            rust: stringify!($ty),
            size: std::mem::size_of::<$ty>(),
            fields,
            constants: vec![$($((stringify!($constant), $constant as u32)),*)?],
            prefix: false,
        }
    }};
}
pub(crate) use uniform_layout;

/// Whether `name` is padding (`pad`, `_pad`, `pad0`, ...: no counterpart needed on the other side).
fn is_padding(name: &str) -> bool {
    let digits = name.trim_start_matches('_').strip_prefix("pad");
    digits.is_some_and(|rest| rest.chars().all(|c| c.is_ascii_digit()))
}

/// The scalar type of `ty`'s elements (`None`: mixed, or not a number).
fn scalar_of(module: &naga::Module, ty: naga::Handle<naga::Type>) -> Option<Scalar> {
    match &module.types[ty].inner {
        naga::TypeInner::Scalar(s) | naga::TypeInner::Vector { scalar: s, .. } => match s.kind {
            naga::ScalarKind::Uint if s.width == 4 => Some(Scalar::U32),
            naga::ScalarKind::Sint if s.width == 4 => Some(Scalar::I32),
            naga::ScalarKind::Float if s.width == 4 => Some(Scalar::F32),
            _ => None,
        },
        naga::TypeInner::Array { base, .. } => scalar_of(module, *base),
        _ => None,
    }
}

/// The value of WGSL constant `name` in `module`.
fn constant_value(module: &naga::Module, name: &str) -> Option<u32> {
    let (_, constant) = module
        .constants
        .iter()
        .find(|(_, c)| c.name.as_deref() == Some(name))?;
    match module.global_expressions[constant.init] {
        naga::Expression::Literal(naga::Literal::U32(v)) => Some(v),
        naga::Expression::Literal(naga::Literal::I32(v)) => u32::try_from(v).ok(),
        naga::Expression::Literal(naga::Literal::AbstractInt(v)) => u32::try_from(v).ok(),
        _ => None,
    }
}

/// Every difference between `layout` and its WGSL struct, as messages.
pub(crate) fn mismatches(layout: &UniformLayout, sources: &[(String, String)]) -> Vec<String> {
    let tag = format!("{} / {} in {}", layout.rust, layout.wgsl, layout.source);
    let Some((_, source)) = sources.iter().find(|(name, _)| name == layout.source) else {
        return vec![format!("{tag}: no such source")];
    };
    let module = match naga::front::wgsl::parse_str(source) {
        Ok(module) => module,
        Err(e) => return vec![format!("{tag}: {}", e.emit_to_string(source))],
    };
    let mut layouter = Layouter::default();
    if let Err(e) = layouter.update(module.to_ctx()) {
        return vec![format!("{tag}: layout: {e}")];
    }
    let Some((_, ty)) = module
        .types
        .iter()
        .find(|(_, t)| t.name.as_deref() == Some(layout.wgsl))
    else {
        return vec![format!("{tag}: no WGSL struct {}", layout.wgsl)];
    };
    let naga::TypeInner::Struct { members, span } = &ty.inner else {
        return vec![format!("{tag}: {} is not a struct", layout.wgsl)];
    };
    let mut errors = Vec::new();
    let span = *span as usize;
    if span != layout.size && !(layout.prefix && span < layout.size) {
        errors.push(format!(
            "{tag}: {} bytes in Rust, {span} in WGSL",
            layout.size
        ));
    }
    let mut covered = vec![false; layout.fields.len()];
    for member in members {
        let name = member.name.as_deref().unwrap_or("?");
        let (offset, size) = (member.offset as usize, layouter[member.ty].size as usize);
        let Some(index) = layout
            .fields
            .iter()
            .position(|f| f.offset <= offset && offset < f.offset + f.size)
        else {
            if !is_padding(name) {
                errors.push(format!("{tag}: WGSL {name} at {offset} has no Rust field"));
            }
            continue;
        };
        let field = &layout.fields[index];
        covered[index] = true;
        // A Rust array may hold several WGSL members (`bias_strides` for `bias_stride_b` ..): their
        // names share its singular.
        let whole = field.offset == offset && field.size == size;
        let singular = field.name.strip_suffix('s').unwrap_or(field.name);
        let named = field.name == name
            || (!whole && name.starts_with(singular))
            || (is_padding(name) && is_padding(field.name));
        if !named {
            errors.push(format!(
                "{tag}: at {offset}, WGSL {name} but Rust {}",
                field.name
            ));
        }
        if offset + size > field.offset + field.size {
            errors.push(format!(
                "{tag}: WGSL {name} ({size} B at {offset}) runs past Rust {} ({} B at {})",
                field.name, field.size, field.offset
            ));
        }
        if let Some(scalar) = field.scalar {
            if scalar_of(&module, member.ty).is_some_and(|s| s != scalar) {
                errors.push(format!("{tag}: {name} is {scalar:?} in Rust, not in WGSL"));
            }
        }
    }
    for (field, covered) in layout.fields.iter().zip(covered) {
        if !covered && !is_padding(field.name) && field.offset < span {
            errors.push(format!(
                "{tag}: Rust {} at {} has no WGSL member",
                field.name, field.offset
            ));
        }
    }
    for &(name, value) in &layout.constants {
        match constant_value(&module, name) {
            Some(v) if v == value => {}
            Some(v) => errors.push(format!("{tag}: {name} is {value} in Rust, {v} in WGSL")),
            None => errors.push(format!("{tag}: no WGSL constant {name}")),
        }
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel module's parameter structs.
    fn all() -> Vec<UniformLayout> {
        [
            crate::kernels::attention::uniform_layouts(),
            crate::kernels::layer_norm::uniform_layouts(),
            crate::kernels::embedding::uniform_layouts(),
            crate::kernels::optimizer::uniform_layouts(),
            crate::kernels::matmul::uniform_layouts(),
            crate::kernels::cross_entropy::uniform_layouts(),
            crate::kernels::elementwise::uniform_layouts(),
            crate::kernels::dispatch::uniform_layouts(),
            crate::kernels::rope::uniform_layouts(),
            crate::kernels::sampling::uniform_layouts(),
            crate::kernels::kv_cache::uniform_layouts(),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    #[test]
    fn rust_parameter_structs_match_their_wgsl() {
        let sources = crate::kernels::shaders::all();
        let layouts = all();
        assert!(layouts.len() >= 20, "{}", layouts.len());
        let errors: Vec<String> = layouts
            .iter()
            .flat_map(|layout| mismatches(layout, &sources))
            .collect();
        assert!(errors.is_empty(), "{}", errors.join("\n"));
    }

    #[test]
    fn a_moved_field_is_caught() {
        #[repr(C)]
        struct Swapped {
            cols: u32,
            rows: u32,
            eps: f32,
            grid_x: u32,
        }
        #[repr(C)]
        struct Retyped {
            rows: u32,
            cols: u32,
            eps: u32,
            grid_x: u32,
        }
        let sources = crate::kernels::shaders::all();
        let swapped = uniform_layout!(
            "layer_norm_forward_cpu",
            "Params",
            Swapped {
                cols,
                rows,
                eps,
                grid_x
            }
        );
        let errors = mismatches(&swapped, &sources);
        assert!(
            errors.iter().any(|e| e.contains("WGSL rows but Rust cols")),
            "{errors:?}"
        );
        let retyped = uniform_layout!(
            "layer_norm_forward_cpu",
            "Params",
            Retyped {
                rows,
                cols,
                eps,
                grid_x
            }
        );
        let errors = mismatches(&retyped, &sources);
        assert!(
            errors.iter().any(|e| e.contains("eps is U32")),
            "{errors:?}"
        );
    }
}
