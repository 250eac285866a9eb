import json,sys
def load(p): return {(r['name'],r['chip']):r for r in json.load(open(p))}
a=load(sys.argv[1]); b=load(sys.argv[2])
ident=0; rows=[]
for k in sorted(a):
    da=a[k]['driver_statistics']; db=b[k]['driver_statistics']
    keys=['VGPRs','Pre-Sched VGPRs','Spilled VGPRs','Scratch size','LDS size','Subgroups per SIMD','Instructions','Inverse Throughput','Code size']
    if all(da[x]==db[x] for x in keys): ident+=1; continue
    it=db['Inverse Throughput']/da['Inverse Throughput']; ins=db['Instructions']/da['Instructions']
    rows.append((k[0],k[1],ins,it,da['VGPRs'],db['VGPRs'],da['Spilled VGPRs'],db['Spilled VGPRs'],da['Scratch size'],db['Scratch size'],da['Subgroups per SIMD'],db['Subgroups per SIMD']))
print(f'{len(a)} pipeline x chip rows: {ident} identical in VGPRs, pre-sched VGPRs, spills, scratch, LDS, waves, instructions, inverse throughput and code size')
for r in rows: print('%-88s %-8s instr %.3f invthr %.3f VGPR %d->%d spill %d->%d scratch %d->%d waves %d->%d'%r)
