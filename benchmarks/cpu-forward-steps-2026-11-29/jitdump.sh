#!/bin/bash
# Runs the forward many times, samples it with perf, and dumps the JIT mapping holding the hottest IPs.

unset GALLIVM_PERF
export MESA_SHADER_CACHE_DIR=/tmp/mc-prof
${BENCH:-target/debug/attention-bench} --backend vulkan --kernels cpu --batch 2 --heads 4 --head-dim 64 --lengths 512 --masks none --paths fused --passes forward --reps 3000 --validate-limit 0 > /tmp/prof/run.txt 2>&1 &
pid=$!
sleep 12
perf record -F 2000 -p $pid -o /tmp/prof/hot.data -- sleep 4 2>/dev/null
perf script -i /tmp/prof/hot.data -F ip 2>/dev/null | sort | uniq -c | sort -rn > /tmp/prof/ips.txt
top=$(head -1 /tmp/prof/ips.txt | awk '{print $2}')
python3 - "$pid" "$top" <<'PY'
import sys,re
pid=int(sys.argv[1]); ip=int(sys.argv[2],16)
for line in open(f'/proc/{pid}/maps'):
    a,b=[int(x,16) for x in line.split()[0].split('-')]
    if a<=ip<b:
        print(line.strip())
        with open(f'/proc/{pid}/mem','rb') as m:
            m.seek(a); data=m.read(b-a)
        open('/tmp/prof/jit.bin','wb').write(data)
        open('/tmp/prof/jit.base','w').write(hex(a))
        break
PY
kill $pid 2>/dev/null || true
