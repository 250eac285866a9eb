// Appended to the kernels that write dK and dV (or db and dV) through two bindings: dV goes through
// dk_buf when the host bound one range over both (strided views of one packed gradient buffer, such
// as the Transformer's dQKV). WebGPU refuses two read-write bindings that overlap in one buffer,
// though no element is in both (binding::bind_output_pair). A flag of the parameter block (a
// uniform branch once per stored element), so that it needs no pipeline variant. OutElem: the
// outputs' element type (f32 unless the common header aliased f16).
fn load_dv(index: u32) -> OutElem {
    if has_flag(FLAG_SHARED_OUTPUTS) {
        return dk_buf[index];
    }
    return dv_buf[index];
}

fn store_dv(index: u32, x: OutElem) {
    if has_flag(FLAG_SHARED_OUTPUTS) {
        dk_buf[index] = x;
    } else {
        dv_buf[index] = x;
    }
}
