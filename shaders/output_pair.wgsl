// Appended to the kernels that write dK and dV (or db and dV) through two bindings: dV goes through
// dk_buf when the host bound one range over both (strided views of one packed gradient buffer, such
// as the Transformer's dQKV). WebGPU refuses two read-write bindings that overlap in one buffer,
// though no element is in both (binding::bind_output_pair). OutElem: the outputs' element type
// (f32 unless the common header aliased f16).
override SHARED_OUTPUTS: bool = false;

fn load_dv(index: u32) -> OutElem {
    if SHARED_OUTPUTS {
        return dk_buf[index];
    }
    return dv_buf[index];
}

fn store_dv(index: u32, x: OutElem) {
    if SHARED_OUTPUTS {
        dk_buf[index] = x;
    } else {
        dv_buf[index] = x;
    }
}
