"""Compares two pipeline dumps: every pipeline of the first must be in the second under its new
label with the same constants and runtime checks, and a source with the same top-level WGSL
declarations (comments and whitespace aside, in any order)."""
import json, os, re, sys, collections
before, after = sys.argv[1], sys.argv[2]

def new_label(label):
    name, *rest = label.split('-')
    name = name.replace('_tiled', '_gpu')
    if name.startswith(('attention_forward_cpu', 'attention_backward_dq_cpu', 'attention_backward_dkdv_cpu')) and 'SUBGROUP8' in rest:
        name = name + '_subgroup'
    return '-'.join([name] + rest)

def items(src):
    src = re.sub(r'//[^\n]*', '', src)
    out, depth, cur = [], 0, []
    for ch in src:
        cur.append(ch)
        if ch in '{(': depth += 1
        elif ch in '})':
            depth -= 1
            if depth == 0 and ch == '}':
                out.append(''.join(cur)); cur = []
        elif ch == ';' and depth == 0:
            out.append(''.join(cur)); cur = []
    rest = ''.join(cur).strip()
    if rest: out.append(rest)
    norm = [' '.join(i.split()) for i in out]
    return collections.Counter(n for n in norm if n)

labels = sorted(f[:-5] for f in os.listdir(before) if f.endswith('.json'))
after_labels = set(f[:-5] for f in os.listdir(after) if f.endswith('.json'))
same = diff = missing = 0
changed_names = collections.Counter()
for label in labels:
    nl = new_label(label)
    if nl not in after_labels:
        missing += 1; print('MISSING', label, '->', nl); continue
    jb = json.load(open(f'{before}/{label}.json')); ja = json.load(open(f'{after}/{nl}.json'))
    ok = jb['constants'] == ja['constants'] and jb['runtime_checks'] == ja['runtime_checks']
    ib = items(open(f'{before}/{label}.wgsl').read()); ia = items(open(f'{after}/{nl}.wgsl').read())
    if not ok or ib != ia:
        diff += 1
        print('DIFF', label, 'constants/checks same' if ok else (jb, ja))
        for k in (ib - ia): print('  only before:', k[:200])
        for k in (ia - ib): print('  only after: ', k[:200])
    else:
        same += 1
    if nl != label: changed_names[label.split('-')[0] + ' -> ' + nl.split('-')[0]] += 1
extra = after_labels - {new_label(l) for l in labels}
print(f'{len(labels)} pipelines before, {len(after_labels)} after: {same} equivalent, {diff} different, {missing} missing, {len(extra)} only after')
for e in sorted(extra)[:20]: print('ONLY AFTER', e)
for k, v in sorted(changed_names.items()): print(f'  renamed {v:4d} {k}')
